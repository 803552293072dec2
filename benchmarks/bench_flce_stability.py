"""--use-fused-linear-cross-entropy's `auto` path under load: the same path in every run.

    python benchmarks/bench_flce_stability.py [--runs 5] [--load 2] [--iters 6] [--configs A B]

The flag exists to take the [tokens, V] logits off the peak; its `auto` chooser ranks by bytes
first within a time allowance (npuspeed.ops.choose, criteria.Smallest), so which path runs must
not hang on a timing race. Configurations of examples/pretrain_gpt.py (one rank, fp32, 64k
vocabulary, 2 layers, hidden 128): A = S 256, micro-batch 2 (issue 35: the chunked path, forced,
gave 0.65x of the peak and 1.03x the tokens/s, and the time-only chooser kept Megatron's path in
one run out of two); B = S 512, micro-batch 4 (the logits dominate). Per configuration: one run
without the flag, one with the chunked path forced (`--fused-linear-cross-entropy-fallback
never`), then --runs runs with `auto` while --load busy processes compete for the CPU. Printed:
the path each auto run took, its forward/backward peak and tokens/s over the flag-off run's.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from harness import Bench  # noqa: E402
from launch import NO_DROPOUT, TINY, run_example  # noqa: E402

MODEL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "65536", "--hidden-size", "128", "--num-layers", "2",
         "--num-attention-heads", "4"]
CONFIGS = {"A": ["--seq-length", "256", "--micro-batch-size", "2", "--global-batch-size", "2"],
           "B": ["--seq-length", "512", "--micro-batch-size", "4", "--global-batch-size", "4"]}
FLAG = ["--use-fused-linear-cross-entropy"]


def path_taken(summary: dict) -> str:
    counters = summary.get("npuspeed_counters", {})
    if counters.get("fused_linear_ce.calls"):
        return "chunked"
    return "megatron" if counters.get("fused_linear_ce.fallback.measured_slower") else "none"


def busy(n: int) -> list[subprocess.Popen]:
    """`n` processes that spin on the CPU (the load a shared host puts on the trial)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--load", type=int, default=2, help="busy processes during the auto runs")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--configs", nargs="+", default=sorted(CONFIGS), choices=sorted(CONFIGS))
    args = parser.parse_args()
    bench = Bench("flce_stability")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            base = TINY + NO_DROPOUT + MODEL + CONFIGS[name] + ["--train-iters", str(args.iters)]
            off = run_example(base, tmp, name=f"{name}-off", timeout=1200)
            forced = run_example(base + FLAG + ["--fused-linear-cross-entropy-fallback", "never"], tmp,
                                 name=f"{name}-forced", timeout=1200)
            peak = lambda s: s["forward_backward_peak_bytes"] / off["forward_backward_peak_bytes"]  # noqa: E731
            speed = lambda s: s["tokens_per_s"] / off["tokens_per_s"]  # noqa: E731
            # tokens per CPU-second: the step's process CPU time, steadier than wall time under load
            cpu = lambda s: off["median_step_cpu_ms"] / s["median_step_cpu_ms"]  # noqa: E731
            print(f"  {name}: forced chunked: peak {peak(forced):.3f}x, tokens/s {speed(forced):.3f}x, "
                  f"tokens per CPU-second {cpu(forced):.3f}x "
                  f"(flag off: peak {off['forward_backward_peak_bytes'] / 2**20:.1f} MiB)", flush=True)
            paths = []
            for run in range(args.runs):
                load = busy(args.load)
                try:
                    auto = run_example(base + FLAG, tmp, name=f"{name}-auto{run}", timeout=1200)
                finally:
                    for proc in load:
                        proc.kill()
                        proc.wait()
                paths.append(path_taken(auto))
                print(f"    auto run {run + 1} (load {os.getloadavg()[0]:.1f}): {paths[-1]}, peak {peak(auto):.3f}x, "
                      f"tokens/s {speed(auto):.3f}x, tokens per CPU-second {cpu(auto):.3f}x", flush=True)
                bench.add(f"{name} auto run {run + 1}", "fp32", baseline_ms=off["median_step_ms"],
                          feature_ms=auto["median_step_ms"], baseline_peak_bytes=off["forward_backward_peak_bytes"],
                          feature_peak_bytes=auto["forward_backward_peak_bytes"],
                          extra={"path": paths[-1], "load": args.load})
            same = max(paths.count(p) for p in set(paths))
            print(f"  {name}: the same path in {same} runs of {len(paths)} ({', '.join(paths)})", flush=True)
    bench.finish()


if __name__ == "__main__":
    main()
