"""The MoE flags end to end (issue 32): the example trained with and without
`--moe-grouped-gemm --use-fused-moe-token-permute-and-unpermute`, same everything else.

    python benchmarks/bench_moe_flags.py [--rounds 2] [--iters 4] [--layers 2] [--seq 2048]

Shape from the issue: EP2 on 2 ranks, bf16, 8 experts top-2, hidden 512, expert FFN 1408,
sequence 2048, micro-batch 1, alltoall dispatcher. Each flag is meant to be chosen per shape
only where it is faster (npuspeed/ops/fused_choice.py), so "on" must not lose: the acceptance
is at least 0.95x the tokens/s of "off". Runs alternate (off, on, off, on, ...); per run the
median step (first iteration left out) of wall time and of CPU time summed over ranks (the
steadier one on a shared host); the ratio is of the medians over rounds. Prints the table and
the release it ran on; nothing is asserted (tests never time).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))

from launch import run_example  # noqa: E402

FLAGS = ["--moe-grouped-gemm", "--use-fused-moe-token-permute-and-unpermute"]


def model_args(opts) -> list[str]:
    return ["--num-layers", str(opts.layers), "--hidden-size", "512", "--ffn-hidden-size", "1408",
            "--moe-ffn-hidden-size", "1408", "--num-attention-heads", "8", "--swiglu",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
            "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
            "--moe-token-dispatcher-type", "alltoall", "--bf16",
            "--seq-length", str(opts.seq), "--max-position-embeddings", str(opts.seq),
            "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", str(opts.iters),
            "--lr", "3e-4", "--use-cpu-initialization", "--log-interval", "1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternating")
    parser.add_argument("--iters", type=int, default=4, help="iterations per run; the first is left out")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    opts = parser.parse_args()
    base = model_args(opts)
    runs = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(opts.rounds):
            for name, extra in (("off", []), ("on", FLAGS)):
                out = run_example(base + extra, Path(tmp), nproc=2, name=f"{name}{r}", timeout=3600)
                wall = out["median_step_ms"]
                cpu = sum(out["median_step_cpu_ms_per_rank"])
                runs[name].append((wall, cpu, out["losses"]))
                print(f"round {r} {name:3s}: median step {wall:9.1f} ms wall, {cpu:9.1f} ms CPU (all ranks), "
                      f"losses {[round(x, 4) for x in out['losses']]}, step ms {[round(x) for x in out['step_ms']]}, "
                      f"step CPU ms (rank 0) {[round(x) for x in out['step_cpu_ms']]}", flush=True)
                if r == 0 and name == "on":  # which path each op took (the per-shape choice)
                    paths = [ln for ln in out["log"].splitlines() if "grouped" in ln.lower() or "permute" in ln.lower()]
                    print("\n".join(f"    {ln.strip()[:200]}" for ln in paths[:8]))
    tokens = 2 * opts.seq  # global batch 2 x sequence per step
    med = {n: (statistics.median(w for w, _, _ in v), statistics.median(c for _, c, _ in v)) for n, v in runs.items()}
    from npuspeed.patching.versions import megatron_version

    print(f"\nmegatron-core {megatron_version()}, {opts.layers} layers, S {opts.seq}, {opts.rounds} rounds")
    print("| run | tokens/s (wall) | step CPU ms (all ranks) |\n|---|---|---|")
    for n in ("off", "on"):
        print(f"| {n} | {tokens / (med[n][0] / 1000):.1f} | {med[n][1]:.0f} |")
    print(f"on/off tokens/s ratio: wall {med['off'][0] / med['on'][0]:.3f}x, CPU {med['off'][1] / med['on'][1]:.3f}x")


if __name__ == "__main__":
    main()
