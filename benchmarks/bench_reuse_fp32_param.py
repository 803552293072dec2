"""--reuse-fp32-param: weight bytes, optimizer-step peak and step time of the example with and without it.

Whole bf16 training runs (subprocesses, the example's --summary-json), baseline and
feature alternated `--rounds` times. A run's step time is the median of its iterations (the
first left out); the row takes the fastest run of each side, since on a shared machine other
work only ever adds time. The feature's own work per step (rebuilding the fp32 masters and
splitting them again, as the step does) is also timed alone, single-threaded like the runs,
over as many parameters as the model has, and shown as a share of the baseline step.
    python benchmarks/bench_reuse_fp32_param.py [--iters 20] [--hidden 512] [--rounds 3]
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


def codec_ms_per_step(params: int, repeat: int = 5) -> float:
    """materialize + release of SharedMasters over `params` elements in the model's layer shapes
    (1 thread, as the runs use), fastest of `repeat`; the Bench made in main() has already
    given this process the runs' allocator (tracking + block cache)."""
    import time

    import torch

    from npuspeed.features.reuse_fp32_param.shared_masters import SharedMasters

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        chunk = 1 << 20
        mains = [torch.randn(min(chunk, params - i)) * 0.02 for i in range(0, params, chunk)]
        shared = SharedMasters([(m.to(torch.bfloat16), m) for m in mains])
        shared.release()
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            shared.materialize()
            shared.release()
            best = min(best, time.perf_counter() - t0)
        return best * 1e3
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", choices=["tp1", "dp2"], default=["tp1", "dp2"])
    opts = parser.parse_args()
    model = ["--bf16", "--use-cpu-initialization", "--hidden-size", str(opts.hidden), "--num-layers",
             str(opts.layers), "--num-attention-heads", "8", "--seq-length", "256",
             "--micro-batch-size", "4", "--train-iters", str(opts.iters), "--log-interval", "100"]
    layouts = {"tp1": (1, []), "dp2 distributed optimizer": (2, ["--use-distributed-optimizer"])}
    layouts = {k: v for k, v in layouts.items() if k.split()[0] in opts.layouts}
    bench = Bench("reuse_fp32_param")
    with tempfile.TemporaryDirectory() as tmp:
        for case, (nproc, extra) in layouts.items():
            runs = {"base": [], "reuse": []}
            for _ in range(opts.rounds):
                for name, flag in (("base", []), ("reuse", ["--reuse-fp32-param"])):
                    runs[name].append(run_example(model + extra + flag, Path(tmp), nproc=nproc, name=name))
            base, reuse = runs["base"][-1], runs["reuse"][-1]
            assert base["losses"] == reuse["losses"], "losses differ: the feature must be bitwise"
            base_ms = min(r["median_step_ms"] for r in runs["base"])
            # elements whose masters this rank keeps: weight bytes = 2 P + 4 P / dp with the
            # distributed optimizer (P / dp of them), 6 P without (all P)
            shard = base["weight_bytes"] // 6 if nproc == 1 else base["weight_bytes"] // (2 * nproc + 4)
            codec_ms = codec_ms_per_step(shard)
            row = bench.add(
                case, "bf16",
                baseline_ms=base_ms,
                feature_ms=min(r["median_step_ms"] for r in runs["reuse"]),
                baseline_peak_bytes=base["peak_mem_bytes"], feature_peak_bytes=reuse["peak_mem_bytes"],
                extra={"baseline_weight_bytes": base["weight_bytes"], "feature_weight_bytes": reuse["weight_bytes"],
                       "weight_ratio": round(reuse["weight_bytes"] / base["weight_bytes"], 4),
                       "hidden": opts.hidden, "layers": opts.layers, "iters": opts.iters,
                       "codec_ms_per_step": round(codec_ms, 2),
                       "baseline_step_peak_bytes": base["optimizer_step_peak_bytes"],
                       "feature_step_peak_bytes": reuse["optimizer_step_peak_bytes"],
                       "step_peak_ratio": round(reuse["optimizer_step_peak_bytes"]
                                                / base["optimizer_step_peak_bytes"], 4),
                       "codec_share_of_step": round(codec_ms / base_ms, 4),
                       "run_medians_ms": {k: [round(r["median_step_ms"], 1) for r in v] for k, v in runs.items()}},
            )
            print(f"[reuse_fp32_param] {case}: weight bytes {base['weight_bytes']} -> {reuse['weight_bytes']} "
                  f"({row.extra['weight_ratio']:.3f}x), optimizer-step peak {row.extra['step_peak_ratio']:.4f}x, "
                  f"speed {row.speedup:.3f}x, bitwise losses; the codec alone "
                  f"{codec_ms:.1f} ms per step = {100 * codec_ms / base_ms:.1f}% of the baseline step")
    bench.finish()


if __name__ == "__main__":
    main()
