"""One rank of `npuspeed plan --calibrate`: Megatron's real modules timed inside a real group.

Every rank of the calibration world runs the same work at the same time, as a training
step's ranks do: a tensor/context/expert-parallel group waits inside its collectives for
its peers and for the cores they share, data-parallel replicas contend for the host. Per
parallel group shape (TP, SP, CP, EP) it times, forward and backward apart, one
TransformerLayer (a GPTModel chunk without pre/post process), the embedding (a chunk with
pre-process, less the layer) and the output layer with the loss (the full chunk, less both),
at the run's micro-batch and at half its tokens (to split per-module overhead from per-token
work). With TP = 1 (all ranks data-parallel) it times Megatron's finalize_model_grads and
optimizer step, plain and distributed, at one and two layers (a fixed part and a part per
parameter), and the world's all-reduce and a point-to-point send (latency and bandwidth).
Each figure is kept twice, both the slowest rank's: the fastest of the repeats on each rank,
and their median (`<part>_median`). A step is a sum of many calls, so it takes each call's
typical time, not its luckiest: where a call waits on its peers (TP/CP/EP collectives on a
host whose ranks share cores) the fastest repeat is well below the typical one (speed.py).
"""
from __future__ import annotations

import os
import time

import torch

REPEATS = 5
MIN_ROUNDS, MAX_ROUNDS = 5, 40
GROUP_BUDGET_S = 4.0  # per group shape: rounds continue while it lasts


def _device() -> torch.device:
    """The accelerator's device: NCCL/HCCL collectives take device tensors, gloo host ones."""
    from npuspeed import get_accelerator

    return get_accelerator().device()


def _sync_max(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _median(values: list) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def _once(fn) -> tuple[float, float]:
    """(forward s, backward s) of one call: `fn()` returns (out, grad or None) after the forward."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    out, grad = fn()
    t1 = time.perf_counter()
    if grad is None:
        out.backward()
    else:
        out.backward(grad)
    return t1 - t0, time.perf_counter() - t1


def _rounds(fns: dict, budget_s: float) -> dict:
    """{fn: ((fastest forward, fastest backward), (median forward, median backward))}, each the
    slowest rank's. The fns take turns, round after round (a warm-up, then at least
    MIN_ROUNDS, more while the budget lasts, at most MAX_ROUNDS), so a burst of other work on
    a shared host hits them all alike."""
    import torch.distributed as dist

    seen = {k: ([], []) for k in fns}
    start = time.perf_counter()
    for i in range(MAX_ROUNDS + 1):
        for k, fn in fns.items():
            f, b = _once(fn)
            if i:
                seen[k][0].append(f)
                seen[k][1].append(b)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=_device())
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # every rank stops after the same round
        if i >= MIN_ROUNDS and float(elapsed) > budget_s:
            break
    return {k: ((_sync_max(min(f)), _sync_max(min(b))), (_sync_max(_median(f)), _sync_max(_median(b))))
            for k, (f, b) in seen.items()}


def _init_groups(g: dict, seed: int) -> None:
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    kwargs = dict(tensor_model_parallel_size=g["tp"], pipeline_model_parallel_size=1,
                  expert_model_parallel_size=g.get("ep", 1))
    if g.get("cp", 1) > 1:
        kwargs["context_parallel_size"] = g["cp"]
    if g.get("etp"):
        kwargs["expert_tensor_parallel_size"] = g["etp"]
    mpu.initialize_model_parallel(**kwargs)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _inputs(spec, b: int, s: int, g: dict):
    vocab = spec.model.vocab
    tokens = torch.randint(0, vocab, (b, s))
    positions = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
    return tokens, positions, torch.randint(0, vocab, (b, s))


def _ddp(model, cfg, spec):
    """Wrapped as training wraps it: DDP's per-parameter hooks add each gradient into the buffer."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig

    return DDP(config=cfg, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=spec.batch.dtype != "fp32"),
               module=model)


def _schedule_overhead(full, cfg, tokens, positions, labels, b: int, s: int, full_s: tuple) -> tuple:
    """Seconds per micro-batch Megatron's schedule adds to a chunk's forward and backward
    (its forward_step/loss calls, loss scaling, output deallocation): (from the fastest runs,
    from the median runs), `full_s` the chunk's own (fastest, median) forward + backward."""
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func

    def loss_func(output):
        loss = output.float().sum() / output.numel()
        return loss, {"lm loss": loss.detach()}

    def forward_step(_it, model):
        return model(tokens, positions, None, labels=labels), partial(loss_func)

    run = get_forward_backward_func()
    m = 4
    times = []
    import torch.distributed as dist

    for i in range(2 * REPEATS):
        dist.barrier()
        t0 = time.perf_counter()
        run(forward_step_func=forward_step, data_iterator=iter(()), model=full, num_microbatches=m, seq_length=s,
            micro_batch_size=b, decoder_seq_length=s, forward_only=False)
        if i:
            times.append(time.perf_counter() - t0)
    return tuple(max(_sync_max(t) / m - f, 0.0) for t, f in ((min(times), full_s[0]), (_median(times), full_s[1])))


def time_group(spec, g: dict, points: list[tuple[int, int]]) -> dict:
    """Layer, embedding and head+loss times of one parallel group shape at (b, s) points."""
    from megatron.core import parallel_state as mpu

    from npuspeed.plan import calib_model

    _init_groups(g, 1234)
    dtype = calib_model.dtype_of(spec)
    models = {}
    for name, pre, post in (("block", False, False), ("pre", True, False), ("full", True, True)):
        model, cfg = calib_model.build(spec, 1, g, pre=pre, post=post)
        models[name] = _ddp(model if post else calib_model.unwrap(model), cfg, spec)
    block, pre = models["block"], models["pre"]
    full = models["full"]
    cp = g.get("cp", 1)
    h = spec.model.hidden
    out = {"tokens": [list(p) for p in points], "layer": [], "pre": [], "full": [], "schedule": 0.0}
    fns, inputs = {}, []
    for i, (b, s) in enumerate(points):
        s_local = s // cp
        rows = s_local // g["tp"] if g["sp"] else s_local
        x = torch.randn(rows, b, h, dtype=dtype)
        tokens, positions, labels = _inputs(spec, b, s_local, g)
        inputs.append((tokens, positions, labels, b, s_local))

        def run_block(x=x, block=block):
            x = x.detach().requires_grad_()
            block.module.set_input_tensor(x)
            y = block(None, None, None)
            return y, torch.randn_like(y)

        def run_pre(tokens=tokens, positions=positions, pre=pre):
            y = pre(tokens, positions, None)
            return y, torch.randn_like(y)

        def run_full(tokens=tokens, positions=positions, labels=labels, full=full):
            loss = full(tokens, positions, None, labels=labels)
            return loss.float().sum() / loss.numel(), None

        fns.update({("layer", i): run_block, ("pre", i): run_pre, ("full", i): run_full})
    timed = _rounds(fns, GROUP_BUDGET_S)
    for part in ("layer", "pre", "full"):
        out[part] = [list(timed[(part, i)][0]) for i in range(len(points))]
        out[part + "_median"] = [list(timed[(part, i)][1]) for i in range(len(points))]
    tokens, positions, labels, b, s_local = inputs[0]
    out["schedule"], out["schedule_median"] = _schedule_overhead(
        full, cfg, tokens, positions, labels, b, s_local, (sum(out["full"][0]), sum(out["full_median"][0])))
    del block, pre, full, models
    mpu.destroy_model_parallel()
    return out


#: the optimizer's second chunk: the run's layers up to this many (a deeper model extrapolates)
OPTIMIZER_MAX_LAYERS = 4


def optimizer_layers(spec) -> tuple[int, int]:
    """Chunk depths the optimizer is timed at: one layer, and as many as a rank of the run can
    hold (up to OPTIMIZER_MAX_LAYERS), so that plans interpolate between the two points. With
    1 and 2 layers alone the per-parameter slope is one layer's difference of two times each
    holding the embedding, and a 4-layer DP rank read it three times over, noise included."""
    return 1, max(2, min(spec.model.num_layers, OPTIMIZER_MAX_LAYERS))


def time_optimizers(spec, clip_grad: float = 1.0, grouped_gemm: bool = False) -> dict:
    """Megatron's finalize_model_grads and optimizer.step(), plain and distributed, data-parallel
    over the whole calibration world (TP 1), for chunks of `optimizer_layers`, taking turns:
    {kind: {"points": [[params, grad bytes, finalize s, step s], ...], "points_median": (the same
    with the median repeats)}}. The DDP config is the run's: gradient buffers in fp32 under
    mixed precision, the NaN check of every bucket before its reduction (Megatron-LM's default)."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from npuspeed.plan import calib_model

    g = {"tp": 1, "sp": False, "grouped_gemm": grouped_gemm}  # the experts the run builds
    _init_groups(g, 1234)
    mixed = spec.batch.dtype != "fp32"
    runs = {}
    for kind, distributed in (("plain", False), ("distributed", True)):
        for layers in optimizer_layers(spec):
            model, cfg = calib_model.build(spec, layers, g, pre=True, post=True)
            ddp = DDP(config=cfg, ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=mixed, use_distributed_optimizer=distributed,
                check_for_nan_in_grad=spec.extra.get("check_for_nan_in_grad", True)), module=model)
            opt = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=1e-4, weight_decay=0.01, clip_grad=clip_grad, bf16=spec.batch.dtype == "bf16",
                fp16=spec.batch.dtype == "fp16", params_dtype=calib_model.dtype_of(spec),
                use_distributed_optimizer=distributed), [ddp])
            cfg.finalize_model_grads_func = finalize_model_grads
            runs[(kind, layers)] = (ddp, opt, ([], []))
    start = time.perf_counter()
    for i in range(MAX_ROUNDS + 1):
        for ddp, opt, seen in runs.values():
            ddp.zero_grad_buffer()
            opt.zero_grad()
            for buf in ddp.buffers:
                buf.grad_data.normal_(0, 1e-3)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            finalize_model_grads([ddp])
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if i:
                seen[0].append(t1 - t0)
                seen[1].append(t2 - t1)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=_device())
        torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
        if i >= MIN_ROUNDS and float(elapsed) > GROUP_BUDGET_S:
            break
    out = {"plain": {"points": [], "points_median": []}, "distributed": {"points": [], "points_median": []}}
    for (kind, _layers), (ddp, _opt, (fin, step)) in runs.items():
        params = sum(p.numel() for p in ddp.parameters())
        grad_bytes = sum(buf.grad_data.numel() * buf.grad_data.element_size() for buf in ddp.buffers)
        out[kind]["points"].append([params, grad_bytes, _sync_max(min(fin)), _sync_max(min(step))])
        out[kind]["points_median"].append([params, grad_bytes, _sync_max(_median(fin)), _sync_max(_median(step))])
    del runs
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    return out


def time_collectives() -> dict:
    """World all-reduce and rank 0 -> 1 send of fp32 tensors: [[bytes, s], ...] each."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    out = {"all_reduce": [], "p2p": []}
    for n in (1 << 12, 1 << 22):
        t = torch.ones(n // 4, device=_device())
        best = float("inf")
        for i in range(REPEATS + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            if i:
                best = min(best, time.perf_counter() - t0)
        out["all_reduce"].append([n, _sync_max(best)])
        if world > 1:
            best = float("inf")
            for i in range(REPEATS + 1):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(t, 1)
                elif rank == 1:
                    dist.recv(t, 0)
                if i:
                    best = min(best, time.perf_counter() - t0)
            out["p2p"].append([n, _sync_max(best if rank in (0, 1) else 0.0)])
    return out


def main(rank: int, world: int, port: int, job: dict, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), PYTHONWARNINGS="ignore")
    torch.set_num_threads(job["threads"])
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    spec = job["spec"]
    result = {"groups": {}, "world": world}
    try:
        from npuspeed import runtime

        runtime.initialize(job["argv"])  # the run's feature patches, as its training script gets them
        dist.init_process_group("gloo", rank=rank, world_size=world)
        for key, g in job["groups"].items():
            result["groups"][key] = time_group(spec, g, job["points"][key])
        if job.get("optimizer"):
            result["optimizer"] = time_optimizers(spec, grouped_gemm=job.get("grouped_gemm", False))
            result["collective"] = time_collectives()
    except Exception as exc:  # the parent reports it; the other ranks may be blocked in a collective
        import traceback

        queue.put({"rank": rank, "error": f"{exc}\n{traceback.format_exc()}"})
        queue.close()
        queue.join_thread()  # the message is out before the process is
        os._exit(1)
    if rank == 0:
        queue.put(result)
    dist.barrier()
    dist.destroy_process_group()
