"""The example's argument checks: what Megatron-LM's `validate_args` (and megatron.core's
TransformerConfig) would refuse, said as one line that names the flag and the fix.

They run before any process group exists, from the launcher's WORLD_SIZE, so a bad command
line costs a second, not a model build, and ends in `npuspeed: error: ...` (exit status 2)
instead of a bare IndexError or assertion several frames deep in megatron.core.
"""
from __future__ import annotations

import os

from gpt_example import profiling
from npuspeed.errors import UserError


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def _positive(args, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        _need(value is None or value > 0, f"--{name.replace('_', '-')} {value} must be > 0")


def _layout(args, world: int) -> int:
    """Check the parallel layout against the world size; return the data-parallel size."""
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    cp = getattr(args, "context_parallel_size", 1)
    _positive(args, "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
              "context_parallel_size")
    _need(world % (tp * pp * cp) == 0,
          f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
          f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp} = {tp * pp * cp}: launch a "
          f"multiple of {tp * pp * cp} processes or change the sizes")
    dp = world // (tp * pp * cp)
    if ep > 1:
        _need(args.num_experts is not None,
              f"--expert-model-parallel-size {ep} needs --num-experts (a multiple of {ep})")
        _need(args.num_experts % ep == 0,
              f"--num-experts {args.num_experts} is not a multiple of --expert-model-parallel-size {ep}")
        _need(dp % ep == 0, f"--expert-model-parallel-size {ep} does not divide the data-parallel size {dp} "
                            "(world size / (TP x PP)): launch more processes or lower it")
    if args.num_experts is not None:
        _need(args.num_experts > 0, f"--num-experts {args.num_experts} must be > 0 (or drop it)")
        _need(args.moe_router_topk <= args.num_experts,
              f"--moe-router-topk {args.moe_router_topk} is more than --num-experts {args.num_experts}")
    return dp


def _pipeline(args) -> None:
    pp, layers, vpp = args.pipeline_model_parallel_size, args.num_layers, args.num_layers_per_virtual_pipeline_stage
    _need(layers % pp == 0, f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size "
                            f"{pp}: use a multiple of {pp} layers")
    if vpp is not None:
        _need(pp > 1, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        _need((layers // pp) % vpp == 0,
              f"--num-layers-per-virtual-pipeline-stage {vpp} does not divide the {layers // pp} layers of "
              "each pipeline stage (--num-layers / --pipeline-model-parallel-size)")
    if getattr(args, "overlap_p2p_comm", False):
        _need(vpp is not None, "--overlap-p2p-comm overlaps the interleaved schedule's sends and receives: add "
                               "--num-layers-per-virtual-pipeline-stage N or drop --overlap-p2p-comm")
        _need(getattr(args, "schedules_method", None) is None,
              "--overlap-p2p-comm is for Megatron's interleaved schedule, not --schedules-method dualpipev "
              "(which posts its own transfers): drop one")


def _attention(args) -> None:
    tp, heads, hidden = args.tensor_model_parallel_size, args.num_attention_heads, args.hidden_size
    _need(heads % tp == 0, f"--num-attention-heads {heads} is not a multiple of "
                           f"--tensor-model-parallel-size {tp}: each rank takes heads/TP heads")
    if args.kv_channels is None:
        _need(hidden % heads == 0, f"--hidden-size {hidden} is not divisible by --num-attention-heads {heads}: "
                                   "change one, or set --kv-channels")
    if args.group_query_attention:
        groups = args.num_query_groups
        _need(groups is not None, "--group-query-attention needs --num-query-groups N")
        _positive(args, "num_query_groups")
        _need(heads % groups == 0, f"--num-attention-heads {heads} is not a multiple of --num-query-groups {groups}")
        _need(groups % tp == 0, f"--num-query-groups {groups} is not a multiple of --tensor-model-parallel-size "
                                f"{tp}: each rank needs whole query groups")
    ffn = args.ffn_hidden_size
    _need(ffn % tp == 0, f"--ffn-hidden-size {ffn} is not divisible by --tensor-model-parallel-size {tp}")
    if args.multi_latent_attention:
        _need(not args.group_query_attention, "--multi-latent-attention excludes --group-query-attention")
        # npuspeed's attention replacements assume one head size for queries, keys and values
        for flag, on in (("--use-flash-attn", getattr(args, "use_flash_attn", False)),
                         ("--context-parallel-size", args.context_parallel_size > 1)):
            _need(not on, f"{flag} with --multi-latent-attention is not supported by npuspeed yet (MLA's value "
                          "heads differ from its query/key heads): drop it")
    else:
        _need(args.rope_type is None, f"--rope-type {args.rope_type} is multi-latent attention's; drop it or add "
                                      "--multi-latent-attention")
    freq = args.moe_layer_freq
    if isinstance(freq, list):
        _need(len(freq) == args.num_layers, f"--moe-layer-freq has {len(freq)} entries for --num-layers "
                                            f"{args.num_layers}: give one per layer")


def _sequence(args) -> None:
    seq, maxpos = args.seq_length, args.max_position_embeddings
    _need(maxpos >= seq, f"--seq-length {seq} is longer than --max-position-embeddings {maxpos}: raise "
                         f"--max-position-embeddings to at least {seq} or shorten --seq-length")
    if args.sequence_parallel:
        tp = args.tensor_model_parallel_size
        _need(seq % tp == 0, f"--sequence-parallel splits --seq-length {seq} over "
                             f"--tensor-model-parallel-size {tp}: use a multiple of {tp}")
    _need(0.0 < args.rotary_percent <= 1.0, f"--rotary-percent {args.rotary_percent} must be in (0, 1]")


def _training(args, dp: int) -> None:
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    if gbs is not None:
        _need(gbs % (mbs * dp) == 0,
              f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {mbs} x data-parallel "
              f"size {dp} = {mbs * dp}: use a multiple of {mbs * dp}")
    _need(args.min_lr <= args.lr, f"--min-lr {args.min_lr} is above --lr {args.lr}")
    _need(not (args.bf16 and args.fp16), "--bf16 and --fp16 exclude each other: pick one")
    peak = getattr(args, "device_peak_tflops", None)
    _need(peak is None or peak > 0, f"--device-peak-tflops {peak} must be > 0 (one device's bf16 dense peak; "
                                    "drop it to use the table's or none)")
    if args.overlap_param_gather:
        _need(args.use_distributed_optimizer, "--overlap-param-gather needs --use-distributed-optimizer")
        _need(args.overlap_grad_reduce, "--overlap-param-gather needs --overlap-grad-reduce")
    if args.recompute_granularity == "selective":
        _need(args.recompute_method is None, "--recompute-method applies to --recompute-granularity full "
                                             "only: drop it or use full")
    if args.recompute_granularity == "full":
        _need(args.recompute_method is not None,
              "--recompute-granularity full needs --recompute-method uniform or block")
        _need(args.recompute_num_layers is not None,
              "--recompute-granularity full needs --recompute-num-layers N")
    elif args.recompute_method is not None or args.recompute_num_layers is not None:
        _need(False, "--recompute-method / --recompute-num-layers need --recompute-granularity full")


def _checkpointing(args) -> None:
    _positive(args, "save_interval")
    _need(args.ckpt_step is None or args.load, "--ckpt-step needs --load DIR (the checkpoint to read)")
    _need(args.save_interval is None or args.save,
          "--save-interval needs --save DIR (where to write the checkpoints)")
    timeout = getattr(args, "distributed_timeout_minutes", None)
    _need(timeout is None or timeout > 0, f"--distributed-timeout-minutes {timeout} must be > 0")


def _data(args) -> None:
    from gpt_example.data import build_tokenizer

    _need(not (args.data_path and args.mock_data), "--mock-data and --data-path exclude each other; drop one")
    _positive(args, "make_vocab_size_divisible_by")
    try:
        build_tokenizer(args)
    except (ValueError, ImportError) as exc:  # tokenizer.py's messages name the flag and the fix
        raise UserError(str(exc)) from exc
    for prefix in args.data_path or []:
        if os.path.isfile(prefix) or os.path.isfile(prefix + ".bin") or _is_weight(prefix):
            continue
        raise UserError(f"--data-path {prefix}: {prefix}.bin not found. Make it with "
                        "examples/preprocess_data.py (--output-prefix P writes P_text_document.bin/.idx; "
                        "pass --data-path P_text_document)")


def _is_weight(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False


def validate_args(args, world_size: int | None = None) -> None:
    """Raise UserError for the first setting Megatron-LM would refuse (world size: WORLD_SIZE)."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    _positive(args, "micro_batch_size", "global_batch_size", "num_layers", "hidden_size", "num_attention_heads",
              "seq_length", "ffn_hidden_size", "train_iters", "log_interval")
    dp = _layout(args, world)
    _pipeline(args)
    _attention(args)
    _sequence(args)
    _training(args, dp)
    _checkpointing(args)
    _data(args)
    profiling.check(args)
