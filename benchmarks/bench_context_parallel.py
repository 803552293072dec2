"""Context parallelism: peak memory per rank and tokens/s of each algorithm (issue 15).

A Llama-style bf16 model (RMSNorm, SwiGLU, RoPE, 8 heads in 4 query groups, --use-flash-attn)
trains through examples/pretrain_gpt.py at one global sequence length S on 1 rank (CP 1, the
baseline) and on 2 and 4 gloo ranks with each algorithm: ring (megatron_cp_algo), Ulysses,
and hybrid (Ulysses 2 x ring 2). Every run has micro-batch 1 and DP 1, so all ranks of a CP
run share one sequence. Peak memory is the example's (largest rank, tracking allocator,
weights + gradients + optimizer + activations); time is the median step without the first.

    python benchmarks/bench_context_parallel.py [--seqs 8192 16384] [--iters 3] [--mem-limit-mib 400]

Rows go to benchmarks/results/<device>.csv (baseline = CP 1 at the same S), a PNG to
benchmarks/results/context_parallel_<device>.png. `--mem-limit-mib` is the per-rank memory
limit of the run: the script names the longest measured S whose CP 1 peak exceeds it while a
CP run's fits, and, from each layout's measured bytes per token (peaks grow linearly in S on
this path: fixed part + slope from the two measured S), the longest S each layout would hold.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tools"))

from harness import Bench  # noqa: E402
from launch import run_example  # noqa: E402

MODEL = ["--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "704", "--num-attention-heads", "8",
         "--group-query-attention", "--num-query-groups", "4", "--normalization", "RMSNorm", "--swiglu",
         "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--bf16", "--use-flash-attn", "--use-cpu-initialization", "--micro-batch-size", "1",
         "--global-batch-size", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "3e-4",
         "--make-vocab-size-divisible-by", "128", "--log-interval", "1"]
LAYOUTS = {  # name: (ranks, flags)
    "ring CP2": (2, ["--context-parallel-algo", "megatron_cp_algo"]),
    "ulysses CP2": (2, ["--context-parallel-algo", "ulysses_cp_algo"]),
    "ring CP4": (4, ["--context-parallel-algo", "megatron_cp_algo"]),
    "ulysses CP4": (4, ["--context-parallel-algo", "ulysses_cp_algo"]),
    "hybrid CP4 (2x2)": (4, ["--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "2"]),
}


def _train(seq: int, iters: int, ranks: int, flags: list[str], tmp: Path, name: str) -> dict:
    args = MODEL + ["--seq-length", str(seq), "--train-iters", str(iters)] + flags
    if ranks > 1:
        args += ["--context-parallel-size", str(ranks)]
    run = run_example(args, tmp, nproc=ranks, name=name, timeout=3600)
    return {"ms": run["median_step_ms"], "peak": run["peak_mem_bytes"], "tokens_per_s": seq / (run["median_step_ms"] / 1e3),
            "losses": run["losses"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--mem-limit-mib", type=float, default=400.0,
                        help="per-rank memory limit of the run (MiB) for the 'cannot hold' line")
    opts = parser.parse_args()
    bench = Bench("context_parallel")
    opts.layouts = [name for name in opts.layouts if bench.ranks_fit(LAYOUTS[name][0])]
    tmp = Path(tempfile.mkdtemp(prefix="bench_cp_"))
    measured: dict[tuple[int, str], dict] = {}
    for seq in opts.seqs:
        base = measured[(seq, "CP1")] = _train(seq, opts.iters, 1, [], tmp, f"cp1_{seq}")
        for name in opts.layouts:
            ranks, flags = LAYOUTS[name]
            run = measured[(seq, name)] = _train(seq, opts.iters, ranks, flags, tmp, f"{name.split()[0]}{ranks}_{seq}")
            row = bench.add(f"S={seq} {name}", "bf16", baseline_ms=base["ms"], feature_ms=run["ms"],
                            baseline_peak_bytes=base["peak"], feature_peak_bytes=run["peak"],
                            extra={"seq": seq, "ranks": ranks, "tokens_per_s": round(run["tokens_per_s"], 1),
                                   "cp1_tokens_per_s": round(base["tokens_per_s"], 1),
                                   "first_loss_diff": abs(run["losses"][0] - base["losses"][0])})
            print(f"  S={seq} {name}: peak {run['peak'] / 2**20:.1f} MiB/rank ({row.mem_ratio:.2f}x CP1), "
                  f"{run['tokens_per_s']:.0f} tokens/s (CP1 {base['tokens_per_s']:.0f})", flush=True)
    bench.finish()
    _limit_lines(measured, opts)


def _limit_lines(measured: dict, opts) -> None:
    limit = opts.mem_limit_mib * 2**20
    print(f"\nper-rank memory limit {opts.mem_limit_mib:.0f} MiB:")
    for seq in sorted(opts.seqs, reverse=True):
        cp1 = measured[(seq, "CP1")]["peak"]
        fits = [n for n in opts.layouts if measured[(seq, n)]["peak"] <= limit]
        if cp1 > limit and fits:
            print(f"  longest measured S that one rank cannot hold ({cp1 / 2**20:.0f} MiB) but CP can: {seq} "
                  f"({', '.join(fits)})")
            break
    lo, hi = min(opts.seqs), max(opts.seqs)
    for name in ["CP1", *opts.layouts]:
        a, b = measured[(lo, name)]["peak"], measured[(hi, name)]["peak"]
        slope = (b - a) / (hi - lo) if hi > lo else b / hi  # bytes per extra token; the rest is fixed
        fixed = b - slope * hi
        print(f"  {name}: {slope / 1024:.1f} KiB per token per rank + {fixed / 2**20:.0f} MiB fixed -> holds "
              f"S <= {int((limit - fixed) / slope):,} within the limit (linear in S between the measured points)")

if __name__ == "__main__":
    main()
