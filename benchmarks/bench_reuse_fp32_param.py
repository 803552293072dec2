"""--reuse-fp32-param: weight bytes and step time of the example with and without it.

Whole bf16 training runs (subprocesses, the example's --summary-json), baseline and
feature alternated twice; the step time is the median of the runs' mean step times.
    python benchmarks/bench_reuse_fp32_param.py [--iters 12] [--hidden 512]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from harness import Bench  # noqa: E402
from launch import run_example  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    opts = parser.parse_args()
    model = ["--bf16", "--use-cpu-initialization", "--hidden-size", str(opts.hidden), "--num-layers",
             str(opts.layers), "--num-attention-heads", "8", "--seq-length", "256",
             "--micro-batch-size", "4", "--train-iters", str(opts.iters), "--log-interval", "100"]
    layouts = {"tp1": (1, []), "dp2 distributed optimizer": (2, ["--use-distributed-optimizer"])}
    bench = Bench("reuse_fp32_param")
    with tempfile.TemporaryDirectory() as tmp:
        for case, (nproc, extra) in layouts.items():
            runs = {"base": [], "reuse": []}
            for _ in range(opts.rounds):
                for name, flag in (("base", []), ("reuse", ["--reuse-fp32-param"])):
                    runs[name].append(run_example(model + extra + flag, Path(tmp), nproc=nproc, name=name))
            base, reuse = runs["base"][-1], runs["reuse"][-1]
            assert base["losses"] == reuse["losses"], "losses differ: the feature must be bitwise"
            row = bench.add(
                case, "bf16",
                baseline_ms=statistics.median(r["mean_step_ms"] for r in runs["base"]),
                feature_ms=statistics.median(r["mean_step_ms"] for r in runs["reuse"]),
                baseline_peak_bytes=base["peak_mem_bytes"], feature_peak_bytes=reuse["peak_mem_bytes"],
                extra={"baseline_weight_bytes": base["weight_bytes"], "feature_weight_bytes": reuse["weight_bytes"],
                       "weight_ratio": round(reuse["weight_bytes"] / base["weight_bytes"], 4),
                       "hidden": opts.hidden, "layers": opts.layers, "iters": opts.iters},
            )
            print(f"[reuse_fp32_param] {case}: weight bytes {base['weight_bytes']} -> {reuse['weight_bytes']} "
                  f"({row.extra['weight_ratio']:.3f}x), speed {row.speedup:.3f}x, bitwise losses")
    bench.finish()


if __name__ == "__main__":
    main()
