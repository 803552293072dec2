"""The training loop: set-up, Megatron's schedules, Megatron-LM-style log lines, summary JSON."""
from __future__ import annotations

import datetime
import json
import os
import random
import statistics
import time
from functools import partial

import numpy as np
import torch
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from gpt_example import checkpoint, data, profiling, throughput
from gpt_example.failures import NonFiniteError, Progress, check_for_nan, report_nonfinite, stop_cleanly
from gpt_example.model import (
    _supported, build_model, initialize_by_global_name, padded_vocab_size, transformer_config,
)
from npuspeed import get_accelerator, telemetry
from npuspeed.features.device import fused_adam
from npuspeed.features.fused_attention.forward import attention_calls
from npuspeed.features.moe_common import a2a_clock
from npuspeed.features.pipeline.bubble import measure as bubble_measure
from npuspeed.features.pipeline.bubble import summary as bubble_summary
from npuspeed.memory import weight_bytes


def init_distributed(args) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    acc = get_accelerator()
    if acc.name != "cpu":
        acc.set_device(int(os.environ["LOCAL_RANK"]))
    backend = args.distributed_backend or acc.dist_backend
    minutes = getattr(args, "distributed_timeout_minutes", None)
    torch.distributed.init_process_group(
        backend=backend, timeout=None if minutes is None else datetime.timedelta(minutes=minutes),
    )
    # Megatron's own groups (TP, PP, DP, ...) take the same timeout: a hung peer is noticed in
    # any collective. Unset, it is torch.distributed's default for the backend, as above.
    mpu.initialize_model_parallel(**_supported(mpu.initialize_model_parallel, dict(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=_vpp(args),
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        **_cp_kwargs(args),
        distributed_timeout_minutes=minutes if minutes is not None else _default_minutes(backend),
    )))


def _default_minutes(backend: str) -> float:
    from torch.distributed import constants

    default = getattr(constants, "default_pg_nccl_timeout", None) if backend == "nccl" else None
    return (default or constants.default_pg_timeout).total_seconds() / 60


def _cp_kwargs(args) -> dict:
    return {"context_parallel_size": args.context_parallel_size} if args.context_parallel_size > 1 else {}


def _vpp(args):
    from gpt_example.model import _vpp_size

    return _vpp_size(args)


def set_seeds(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor, check_finite: bool = False):
    """Mean loss over the micro-batch's tokens. Under CP each rank has part of the tokens: the
    sums and counts are all-reduced over the CP group (the value), while the gradient flows
    through this rank's sum only (Megatron's schedule multiplies by the CP size and DDP
    averages over DP x CP, which together give the gradient of the global mean)."""
    losses = output.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    local = torch.stack([torch.sum(losses * mask), mask.sum()])
    total = local.detach().clone()
    if mpu.get_context_parallel_world_size() > 1:
        torch.distributed.all_reduce(total, group=mpu.get_context_parallel_group())
    loss = local[0] / total[1]
    if check_finite and not torch.isfinite(loss):  # as Megatron-LM's pretrain_gpt.py, before backward
        raise NonFiniteError(f"found {'NaN' if torch.isnan(loss) else 'Inf'} in local forward loss calculation")
    # A copy: the schedule divides the returned loss in place by the micro-batch count.
    return loss, {"lm loss": (total[0] / total[1]).clone()}


def batch_layout(args, eod: int):
    """What a micro-batch needs before the model, or None: packed documents
    (--reset-attention-mask: PackedSeqParams with --use-flash-attn, else Megatron's S x S mask,
    built on `device`) and the CP split (Megatron's get_batch_on_this_cp_rank).
    Returns (batch, device) -> (batch, mask, packed)."""
    if not args.reset_attention_mask and args.context_parallel_size == 1:
        return None
    from gpt_example import documents

    def layout(batch, device=None):
        packed = mask = None
        if args.reset_attention_mask:
            if getattr(args, "use_flash_attn", False):
                packed = documents.packed_seq_params(batch["tokens"], eod)
            else:  # Megatron's unfused attention needs the S x S mask: made on the device
                tokens = batch["tokens"] if device is None else batch["tokens"].to(device, non_blocking=True)
                mask = documents.document_mask(tokens, eod)
        if args.context_parallel_size > 1:
            batch = documents.cp_split(dict(batch))
        return batch, mask, packed

    return layout


def to_device(batch: dict, mask, packed, device):
    """The micro-batch on the accelerator (as Megatron-LM's get_batch does): tensors copied
    with non_blocking from the DataLoader's pinned memory, the packed-document boundaries too
    (cu_seqlens, as Transformer Engine expects them). Nothing moves on the CPU backend."""
    if device.type == "cpu":
        return batch, mask, packed
    batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
    if packed is not None:
        for name in ("cu_seqlens_q", "cu_seqlens_kv"):
            value = getattr(packed, name, None)
            if torch.is_tensor(value):
                setattr(packed, name, value.to(device, non_blocking=True))
    return batch, mask, packed


def forward_step(data_iterator, model, check_finite: bool = False, layout=None, device=None, seen=None):
    batch = next(data_iterator)
    mask = packed = None
    if layout is not None:
        batch, mask, packed = layout(batch, device)
    if device is not None:
        batch, mask, packed = to_device(batch, mask, packed, device)
    if seen is not None:  # where the tensors the model gets live (the summary's batch_devices)
        seen.update(t.device.type for t in (*batch.values(), mask) if torch.is_tensor(t))
    output = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"], packed_seq_params=packed)
    return output, partial(loss_func, batch["loss_mask"], check_finite=check_finite)


def build_optimizer(args, model):
    dtype_kwargs = dict(bf16=args.bf16, fp16=args.fp16,
                        params_dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32)
    config = OptimizerConfig(**_supported(OptimizerConfig, dict(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather, **dtype_kwargs,
        # Megatron's hybrid host/device optimizer (npuspeed refuses it without Transformer Engine)
        **({"optimizer_cpu_offload": True, "optimizer_offload_fraction": args.optimizer_offload_fraction or 1.0}
           if getattr(args, "optimizer_cpu_offload", None) else {}),
    )))
    optimizer = get_megatron_optimizer(config, model)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=args.train_iters * args.global_batch_size, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters * args.global_batch_size,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def to_accelerator(chunks):
    """Model chunks onto the accelerator's current device before the Float16/DDP wrappers, as
    Megatron-LM's get_model does (`.cuda(current_device)`): the optimizer wraps device
    parameters and DDP's buffers are allocated beside them. A no-op on the CPU backend."""
    acc = get_accelerator()
    if acc.name == "cpu":
        return chunks
    return [chunk.to(acc.device()) for chunk in chunks]


def wrap_float16(args, config, chunks):
    """As Megatron-LM: bf16/fp16 models take fp32 inputs and return fp32 losses."""
    if not (args.bf16 or args.fp16):
        return chunks
    from megatron.core.transformer.module import Float16Module

    return [Float16Module(config, chunk) for chunk in chunks]


def wrap_ddp(args, config, chunks):
    ddp_config = DistributedDataParallelConfig(**_supported(DistributedDataParallelConfig, dict(
        grad_reduce_in_fp32=args.bf16 or args.fp16, overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather, check_for_nan_in_grad=check_for_nan(args),
    )))
    return [DDP(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=(i > 0))
            for i, chunk in enumerate(chunks)]


def _configure_schedule_hooks(args, config, model, optimizer) -> None:
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if args.overlap_grad_reduce:
        hooks = [m.no_sync for m in model]
        config.no_sync_func = hooks[0] if len(hooks) == 1 else hooks
    if args.overlap_param_gather:
        hooks = [m.start_param_sync for m in model]
        config.param_sync_func = hooks[0] if len(hooks) == 1 else hooks


def _iteration_loss(losses_reduced) -> torch.Tensor:
    """Mean lm loss of the iteration over micro-batches and data-parallel ranks (all ranks get it)."""
    local = torch.zeros(1, dtype=torch.float64, device=_collective_device())
    if (mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0
            and mpu.get_context_parallel_rank() == 0):  # CP ranks report the same (all-reduced) loss
        values = [float(x["lm loss"]) for x in losses_reduced]
        local += sum(values) / len(values)
    torch.distributed.all_reduce(local)
    return local / mpu.get_data_parallel_world_size()


def _collective_device() -> torch.device:
    """Where tensors handed to a collective live: NCCL/HCCL take only device tensors, gloo CPU
    ones (the CPU accelerator's device)."""
    return get_accelerator().device()


def _bubbles() -> list[dict] | None:
    """Every rank's pipeline bubble (bubble_summary.summary), in rank order; None when no rank measured one."""
    mine = bubble_summary.summary()
    if not torch.distributed.is_initialized():
        return [mine] if mine else None
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    return [dict(b, rank=r) for r, b in enumerate(every) if b] or None


def _swap_sizing() -> list[dict]:
    from npuspeed.offload import decisions

    return decisions.all_dicts()


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=_collective_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def _per_rank(value: float, cast=int) -> list:
    """Every rank's value, in rank order (for comparing each rank with `npuspeed plan`)."""
    t = torch.zeros(torch.distributed.get_world_size(), dtype=torch.float64, device=_collective_device())
    t[torch.distributed.get_rank()] = value
    torch.distributed.all_reduce(t)
    return [cast(x) for x in t.tolist()]


def log_line(it, args, step_ms, lr, loss, grad_norm, peak, tokens_per_s, skipped) -> str:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    tflops = throughput.log_segment(args, step_ms, torch.distributed.get_world_size())  # --log-throughput
    return (
        f" [{now}] iteration {it:8d}/{args.train_iters:8d} | consumed samples: {it * args.global_batch_size:12d} "
        f"| elapsed time per iteration (ms): {step_ms:.1f} |{tflops} tokens per second: {tokens_per_s:.1f} "
        f"| learning rate: {lr:.6E} | global batch size: {args.global_batch_size:5d} | lm loss: {loss:.6E} "
        f"| grad norm: {grad_norm:.3f} | number of skipped iterations: {skipped:3d} "
        f"| peak memory (MB): {peak / 2**20:.1f} |"
    )


def main(args) -> dict:
    init_distributed(args)
    progress = Progress(args)
    with stop_cleanly(progress):
        return _train(args, progress)


def _save(args, iteration, model, optimizer, scheduler, progress) -> None:
    progress.saving = True
    checkpoint.save(args.save, iteration, model, optimizer, scheduler, args=args)
    progress.saving = False


def _train(args, progress) -> dict:
    dp = mpu.get_data_parallel_world_size()
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    set_seeds(args.seed)
    tokenizer = data.build_tokenizer(args)
    config = transformer_config(args)
    args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args)
    chunks = build_model(args, config, args.padded_vocab_size)
    if args.use_cpu_initialization:
        initialize_by_global_name(chunks, args, config)
    if args.hf_checkpoint:  # this rank's shards of the Hugging Face weights (npuspeed.convert)
        from gpt_example.ckpt_verify import model_fingerprint
        from npuspeed.convert.into_model import load_into

        load_into(chunks, args.hf_checkpoint, args.padded_vocab_size, model_fingerprint(args))
    chunks = to_accelerator(chunks)
    model = wrap_ddp(args, config, wrap_float16(args, config, chunks))
    optimizer, scheduler = build_optimizer(args, model)
    _configure_schedule_hooks(args, config, model, optimizer)

    iteration = 0
    if args.load:
        same_dir = args.save and os.path.abspath(args.save) == os.path.abspath(args.load)
        iteration = checkpoint.load(args.load, model, optimizer, scheduler,
                                    load_optim=not args.no_load_optim, load_rng=not args.no_load_rng,
                                    step=args.ckpt_step, args=args, fresh_ok=bool(same_dir))
    progress.iteration = iteration
    iterators = [
        data.build_train_iterator(args, tokenizer, iteration * args.global_batch_size,
                                  mpu.get_data_parallel_rank(), dp)
        for _ in model
    ]
    acc = get_accelerator()
    acc.reset_peak_memory_stats()
    rank0 = torch.distributed.get_rank() == 0
    forward_backward = get_forward_backward_func()
    batch_devices: set[str] = set()
    step_func = partial(forward_step, check_finite=check_for_nan(args), layout=batch_layout(args, tokenizer.eod),
                        device=_collective_device(), seen=batch_devices)
    losses, step_times, skipped, nonfinite = [], [], 0, []
    cpu_times = []  # this rank's CPU time per step: steadier than wall time on a shared host
    parts = {"forward_backward_ms": [], "optimizer_step_ms": []}  # rank 0's, per iteration
    run_peak = step_peak = 0  # the run's peak, and the largest optimizer-step peak (above the step's start)
    step_peaks = []  # this rank's optimizer-step peak per iteration
    tokens_per_iter = args.global_batch_size * args.seq_length
    start_iteration = iteration
    profiler = profiling.StepProfiler(args, torch.distributed.get_rank())  # --profile
    perturbed = []  # iterations under the profiler: left out of the step times, as the first one
    while iteration < args.train_iters:
        profiler.begin(iteration)
        t0, c0 = time.perf_counter(), time.process_time()
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = forward_backward(
            forward_step_func=step_func, data_iterator=iterators if len(model) > 1 else iterators[0],
            model=model if len(model) > 1 else model[0], num_microbatches=num_microbatches,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.seq_length, forward_only=False,
        )
        run_peak = max(run_peak, acc.max_memory_allocated())
        acc.reset_peak_memory_stats()
        acc.synchronize()
        t1 = time.perf_counter()
        with profiler.optimizer():
            ok, grad_norm, _ = optimizer.step()
            acc.synchronize()
        t2 = time.perf_counter()
        step_peaks.append(acc.max_memory_allocated())
        step_peak = max(step_peak, step_peaks[-1])
        if ok:
            scheduler.step(increment=args.global_batch_size)
        else:
            skipped += 1
        loss = float(_iteration_loss(reduced).item())
        acc.synchronize()
        step_ms = (time.perf_counter() - t0) * 1000.0
        cpu_times.append((time.process_time() - c0) * 1000.0)
        profiler.end_step(iteration, last=iteration + 1 >= args.train_iters)
        perturbed.append(profiler.perturbed(iteration))
        iteration += 1
        progress.iteration = iteration
        if report_nonfinite(iteration, loss, None if grad_norm is None else float(grad_norm), ok, optimizer):
            nonfinite.append(iteration)
        losses.append(loss)
        if iteration == start_iteration + 1:
            a2a_clock.reset()  # the first iteration's transfers include the process group's set-up
            bubble_measure.reset()
        step_times.append(step_ms)
        parts["forward_backward_ms"].append((t1 - t0) * 1000.0)
        parts["optimizer_step_ms"].append((t2 - t1) * 1000.0)
        if iteration % args.log_interval == 0:
            peak = _max_over_ranks(max(run_peak, acc.max_memory_allocated()))
            if rank0:
                print(log_line(iteration, args, step_ms, optimizer.param_groups[0]["lr"], loss,
                               float(grad_norm or 0.0), peak, tokens_per_iter / (step_ms / 1000.0), skipped),
                      flush=True)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            _save(args, iteration, model, optimizer, scheduler, progress)
        if args.exit_interval and iteration % args.exit_interval == 0:
            break
    if args.save and not (args.save_interval and iteration % args.save_interval == 0):
        _save(args, iteration, model, optimizer, scheduler, progress)
    hidden = a2a_clock.summary()
    if rank0 and hidden:
        print(f"npuspeed: {a2a_clock.line(hidden)}", flush=True)
    bubbles = _bubbles()
    if rank0 and bubbles:
        print(f"npuspeed: {bubble_summary.line(bubbles[0])} (rank 0)", flush=True)
    measured = [t for t, p in zip(step_times[1:], perturbed[1:]) if not p] or step_times
    mean_ms = sum(measured) / max(len(measured), 1)
    summary = {
        "losses": losses,
        "first_iteration": start_iteration + 1,
        "mean_step_ms": mean_ms,
        # rank 0's process CPU time per step (first iteration left out, as for mean_step_ms)
        "mean_step_cpu_ms": sum(cpu_times[1:] or cpu_times) / max(len(cpu_times[1:] or cpu_times), 1),
        # rank 0's process CPU time per iteration, and its median without the first (what a
        # shared host's other work moves least: benchmarks and slow tests compare these)
        "step_cpu_ms": cpu_times,
        "median_step_cpu_ms": statistics.median(cpu_times[1:] or cpu_times) if cpu_times else 0.0,
        # every rank's median process CPU time per step (first iteration left out), rank order:
        # their sum is the step's CPU cost on a host whose other load makes wall time noisy
        "median_step_cpu_ms_per_rank": _per_rank(
            statistics.median(cpu_times[1:] or cpu_times) if cpu_times else 0.0, float),
        "tokens_per_s": tokens_per_iter / (mean_ms / 1000.0) if mean_ms else 0.0,
        "peak_mem_bytes": int(_max_over_ranks(max(run_peak, acc.max_memory_allocated()))),
        # the optimizer step's own peak (largest over iterations and ranks): what masters,
        # gradients, optimizer state and the step's temporaries need at once
        "optimizer_step_peak_bytes": int(_max_over_ranks(step_peak)),
        # the same, each rank's median over iterations (largest over ranks): gloo frees some
        # collective temporaries from its own thread, so one iteration's start may still count
        # them; a buffer the step keeps alive shows in every iteration, hence in the median
        "optimizer_step_peak_bytes_median": int(_max_over_ranks(
            statistics.median(step_peaks) if step_peaks else 0)),
        # each rank's smallest over iterations (largest over ranks): on a loaded host gloo's thread
        # can lag in more than half the iterations; a buffer the step keeps alive is still in this
        "optimizer_step_peak_bytes_min": int(_max_over_ranks(min(step_peaks) if step_peaks else 0)),
        # per rank (rank order): the peak, and the forward/backward part of it (without the step)
        "peak_mem_bytes_per_rank": _per_rank(max(run_peak, acc.max_memory_allocated())),
        "forward_backward_peak_bytes": int(_max_over_ranks(run_peak)),
        "world_size": torch.distributed.get_world_size(),
        "weight_bytes": int(_max_over_ranks(weight_bytes(model, optimizer))),
        "device": acc.name,
        # where every parameter of every model chunk lives, and the tensors the forward step
        # handed the model (tokens, labels, masks, positions): device types, sorted
        "param_devices": sorted({p.device.type for chunk in model for p in chunk.parameters()}),
        "batch_devices": sorted(batch_devices),
        "iterations": iteration,
        # per-iteration times (rank 0) and their median without the first: steadier than the
        # mean on a shared machine, where a burst of other work lands on a few steps
        "step_ms": step_times,
        "median_step_ms": statistics.median(measured) if measured else 0.0,
        # rank 0's npuspeed counters (which kernels ran), and its attention calls with the reason
        # for each kernel (--use-flash-attn)
        "npuspeed_counters": telemetry.snapshot(),
        # rank 0's Adam as it ran: "torch AdamW fused=True" where npuspeed built torch's fused kernel,
        # "torch AdamW (Megatron's default: for-loop)" where it kept Megatron's (None: no torch Adam)
        "adam_implementation": fused_adam.summary(),
        "attention_calls": attention_calls(),
        # rank 0's swap sizing decisions (--swap-attention, --swap-optimizer): what moves, bytes,
        # estimated and measured wait, hidden share, what stays on the device and why ([]: none)
        "swap_sizing": _swap_sizing(),
        # rank 0's expert all-to-alls after the first iteration: the share of their time in flight
        # the compute did not wait for, overall and per phase (warm_up / steady / cool_down with
        # --moe-fb-overlap, layer with --moe-alltoall-overlap-comm); None without expert all-to-alls
        "a2a_hidden_fraction": hidden,
        # each rank's pipeline bubble after the first iteration (--moe-fb-overlap at PP > 1): its
        # time blocked in pipeline send/receive a step beside (PP-1)(F+B) from its own lone
        # forward/backward calls; None when it was not measured
        "pipeline_bubble": bubbles,
        # --profile: rank 0's profiled iterations by category (npuspeed.step_profile), the 15 most
        # expensive kernels, the 1-based iterations covered; None without --profile
        "profile": profiler.summary(),
        "profiled_iterations": [start_iteration + i + 1 for i, p in enumerate(perturbed) if p],
        "skipped_iterations": skipped,
        # iterations whose loss or gradient was NaN/Inf (reported in the log as they happen)
        "nonfinite_iterations": nonfinite,
        "context_parallel_size": args.context_parallel_size,
        # --deterministic-mode in force (deterministic torch algorithms on this rank)
        "deterministic_mode": torch.are_deterministic_algorithms_enabled(),
        # --adaptive-recompute-device-size: the policy the planner chose (None without it)
        "adaptive_policy": getattr(args, "adaptive_policy", None),
        # per iteration (rank 0), the step's two parts as `npuspeed plan` predicts them: zeroing,
        # the schedule's forward/backward and finalize_model_grads (the DP reduction); the
        # optimizer step (clip, update, the distributed optimizer's parameter gather)
        **parts,
        # Megatron-LM's model FLOPs over the mean step (as tokens_per_s), per rank; mfu against the peak
        **throughput.summary_keys(args, mean_ms, torch.distributed.get_world_size(), acc.device_name()),
    }
    if rank0 and args.summary_json:
        # rank 0's own `npuspeed report` at the end of the run: the features on, the paths each
        # chooser took on this run's shapes, the counters (`npuspeed report --run` renders it)
        from npuspeed.reporting import collect

        try:
            summary["npuspeed_report"] = collect()
        except Exception as exc:  # noqa: BLE001 - a report line must not end a finished run: say why it is missing
            print(f"npuspeed: the run's own report could not be collected ({type(exc).__name__}: {exc})", flush=True)
            summary["npuspeed_report"] = {"error": f"{type(exc).__name__}: {exc}"}
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    torch.distributed.barrier()
    mpu.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return summary
