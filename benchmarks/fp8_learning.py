"""Issue 50's learning check on the CPU: the example's tiny Llama (2 layers, hidden 64, learnable
synthetic data, bf16) for 300 iterations without FP8 and with each recipe (hybrid format), one
after another; prints the final loss, the mean of the last 50 losses and each against the bf16
run, with the FP8 counters. Wall times are sequential runs on whatever else the machine runs:
not a speed comparison. About 15 minutes on 2 shared cores.

    PYTHONPATH=. python benchmarks/fp8_learning.py [--iters 300]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from launch import LLAMA, NO_DROPOUT, TINY, run_example  # noqa: E402

RECIPES = {
    "bf16": [],
    "tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16",
                "--fp8-amax-compute-algo", "max"],
    "blockwise": ["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"],
    "mxfp8": ["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"],
}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=300)
    args = p.parse_args()
    base = TINY + NO_DROPOUT + LLAMA + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                        "--seq-length", "128", "--max-position-embeddings", "128", "--bf16",
                                        "--train-iters", str(args.iters), "--log-interval", "50"]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in RECIPES.items():
            start = time.time()
            r = run_example(base + flags, tmp, nproc=1, name=name, timeout=3600)
            runs[name] = (r["losses"], time.time() - start,
                          {k: v for k, v in r["npuspeed_counters"].items() if k.startswith("fp8.")})
    ref = runs["bf16"][0]
    ref_tail = statistics.mean(ref[-50:])
    for name, (losses, wall, counters) in runs.items():
        tail = statistics.mean(losses[-50:])
        print(f"{name:>10}: final {losses[-1]:.4f} ({(losses[-1] - ref[-1]) / ref[-1]:+.1%} vs bf16), "
              f"mean of last 50 {tail:.4f} ({(tail - ref_tail) / ref_tail:+.1%}), wall {wall:.0f} s, {counters}")


if __name__ == "__main__":
    main()
