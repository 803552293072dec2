"""TFLOP/s per rank and MFU of the example's run, with Megatron-LM's model-FLOPs count.

The count is npuspeed.throughput's (Megatron-LM core_v0.16.1 `num_floating_point_operations`);
here it is read from the example's arguments and turned into the log segment Megatron-LM prints
behind `--log-throughput` and the summary keys.
"""
from __future__ import annotations

from npuspeed import throughput


def add_arguments(group) -> None:
    group.add_argument("--log-throughput", action="store_true",
                       help="as Megatron-LM: the log line gains 'throughput per GPU (TFLOP/s/GPU): X' "
                            "(its model-FLOPs count)")
    group.add_argument("--device-peak-tflops", type=float, default=None,
                       help="one device's bf16 dense peak TFLOP/s, for the summary's mfu (default: the table "
                            "entry of the device, e.g. H100 989, A100 312, Ascend 910B 313; none for CPU: "
                            "`npuspeed report --measure-peak` measures one)")


def iteration_flops(args) -> float:
    """Model FLOPs of one iteration (the global batch; needs args.padded_vocab_size)."""
    return throughput.model_flops(throughput.from_args(args), args.global_batch_size)


def log_segment(args, step_ms: float, world_size: int) -> str:
    """Megatron-LM's ` throughput per GPU (TFLOP/s/GPU): X |`, or '' without --log-throughput."""
    if not getattr(args, "log_throughput", False):
        return ""
    tflops = throughput.tflops_per_rank(iteration_flops(args), step_ms, world_size)
    # Megatron-LM's one decimal; below 1 TFLOP/s (CPU, tiny models) four digits, so it is not 0.0
    return f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |" if tflops >= 1 else \
        f" throughput per GPU (TFLOP/s/GPU): {tflops:.4g} |"


def summary_keys(args, mean_step_ms: float, world_size: int, device_name: str | None) -> dict:
    """`tflops_per_s_per_rank` over the measured steps (from mean_step_ms, as tokens_per_s), the
    peak it is compared with and `mfu` (None when no peak is given or known)."""
    peak = args.device_peak_tflops if getattr(args, "device_peak_tflops", None) else throughput.peak_tflops(device_name)
    tflops = throughput.tflops_per_rank(iteration_flops(args), mean_step_ms, world_size)
    return {
        "model_flops_per_iteration": iteration_flops(args),
        "tflops_per_s_per_rank": tflops,
        "device_peak_tflops": peak,
        "mfu": throughput.mfu(tflops, peak),
    }
