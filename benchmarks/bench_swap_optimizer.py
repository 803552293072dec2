"""--swap-optimizer: device peak and step time of the example with and without it.

Whole training runs (subprocesses, the example's --summary-json), baseline and feature
alternated `--rounds` times, per global batch. Reported per case:
- state_bytes: the optimizer state (Adam states + fp32 masters) the swap keeps on the host, from
  its own counters (bytes out - bytes in over the run = one step's worth);
- peak_drop_share: (baseline peak - feature peak) / state_bytes (the acceptance on a device:
  >= 0.8);
- time_ratio: feature / baseline median step time (acceptance on a device: <= 1.10 at global
  batch 8, <= 1.03 at 64); cpu_ratio: the same for rank 0's process CPU time per step (on a
  shared CPU host steadier than wall time).
On the CPU backend the host is the device and the flag leaves the states in place; to measure
the mechanics there, force them: nothing is freed (peak_drop_share about 0) and the ratios are
their cost (the copies are memcpys in one memory, not overlapped).
    NPUSPEED_SWAP_OPTIMIZER=run python benchmarks/bench_swap_optimizer.py   # CPU: a small model
    python benchmarks/bench_swap_optimizer.py --device-config       # Llama 8 x 2048 on a device
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from harness import Bench  # noqa: E402
from launch import run_example  # noqa: E402

#: the README's one-GPU configuration (Llama-style, 8 layers, hidden 2048, GQA 16/4, ffn 5632)
DEVICE_MODEL = ["--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16",
                "--group-query-attention", "--num-query-groups", "4", "--ffn-hidden-size", "5632",
                "--seq-length", "4096", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type",
                "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--use-flash-attn",
                "--micro-batch-size", "1"]
#: time targets of the acceptance, per global batch (feature / baseline step time)
TIME_TARGET = {8: 1.10, 64: 1.03}


def state_bytes(run: dict) -> int:
    c = run["npuspeed_counters"]
    return c.get("swap_optimizer.bytes_out", 0) - c.get("swap_optimizer.bytes_in", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device-config", action="store_true", help="the 8 x 2048 Llama model, global batch 8 and 64")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--global-batches", type=int, nargs="+", default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunk-mb", type=float, default=None, help="--swap-optimizer-chunk-mb (default: the flag's)")
    opts = parser.parse_args()
    if opts.device_config:
        model = DEVICE_MODEL + ["--bf16"]
        batches = opts.global_batches or [8, 64]
    else:
        model = ["--bf16", "--use-cpu-initialization", "--hidden-size", str(opts.hidden), "--num-layers",
                 str(opts.layers), "--num-attention-heads", "8", "--seq-length", "128", "--micro-batch-size", "4"]
        batches = opts.global_batches or [8, 32]
    flag = ["--swap-optimizer"] + (["--swap-optimizer-chunk-mb", str(opts.chunk_mb)] if opts.chunk_mb else [])
    bench = Bench("swap_optimizer")
    with tempfile.TemporaryDirectory() as tmp:
        for gbs in batches:
            args = model + ["--global-batch-size", str(gbs), "--train-iters", str(opts.iters), "--log-interval", "100"]
            runs = {"base": [], "swap": []}
            for _ in range(opts.rounds):
                for name, extra in (("base", []), ("swap", flag)):
                    runs[name].append(run_example(args + extra, Path(tmp), name=name))
            base, swap = runs["base"][-1], runs["swap"][-1]
            assert base["losses"] == swap["losses"], "losses differ: the feature must be bitwise"
            moved = state_bytes(swap)
            base_peak = min(r["peak_mem_bytes"] for r in runs["base"])
            swap_peak = min(r["peak_mem_bytes"] for r in runs["swap"])
            base_ms = min(r["median_step_ms"] for r in runs["base"])
            swap_ms = min(r["median_step_ms"] for r in runs["swap"])
            cpu_ratio = min(r["mean_step_cpu_ms"] for r in runs["swap"]) / min(r["mean_step_cpu_ms"] for r in runs["base"])
            opt_ratio = (min(sum(r["optimizer_step_ms"][1:]) for r in runs["swap"])
                         / max(min(sum(r["optimizer_step_ms"][1:]) for r in runs["base"]), 1e-9))
            share = (base_peak - swap_peak) / moved if moved else 0.0
            target = TIME_TARGET.get(gbs)
            row = bench.add(f"global batch {gbs}", "bf16", baseline_ms=base_ms, feature_ms=swap_ms,
                            baseline_peak_bytes=base_peak, feature_peak_bytes=swap_peak,
                            extra={"state_bytes": moved, "peak_drop_share": round(share, 4),
                                   "time_ratio": round(swap_ms / base_ms, 4), "cpu_ratio": round(cpu_ratio, 4),
                                   "optimizer_step_ratio": round(opt_ratio, 4),
                                   "step_peak_bytes": [base["optimizer_step_peak_bytes"],
                                                       swap["optimizer_step_peak_bytes"]],
                                   "host_is_device": base["device"] == "cpu", "iters": opts.iters,
                                   "run_medians_ms": {k: [round(r["median_step_ms"], 1) for r in v]
                                                      for k, v in runs.items()}})
            verdict = ""
            if base["device"] != "cpu" and target:
                verdict = (f"; acceptance: peak drop >= 80% of state {'met' if share >= 0.8 else 'NOT met'}, "
                           f"time <= {target:.2f}x {'met' if swap_ms / base_ms <= target else 'NOT met'}")
            print(f"[swap_optimizer] {base['device']} global batch {gbs}: state {moved / 2**20:.1f} MiB on the host, "
                  f"peak {base_peak / 2**20:.1f} -> {swap_peak / 2**20:.1f} MiB ({share:.1%} of the state), step "
                  f"time {row.extra['time_ratio']:.3f}x, CPU time {cpu_ratio:.3f}x, optimizer step {opt_ratio:.2f}x"
                  f"{verdict}", flush=True)
    bench.finish()


if __name__ == "__main__":
    main()
