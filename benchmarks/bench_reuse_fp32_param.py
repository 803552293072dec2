"""--reuse-fp32-param: weight bytes, optimizer-step peak and step time of the example with and without it.

Whole bf16 training runs (subprocesses, the example's --summary-json), baseline and
feature alternated `--rounds` times. A run's step time is the median of its iterations (the
first left out); the row takes the fastest run of each side, since on a shared machine other
work only ever adds time. The feature's own work per step (rebuilding the fp32 masters and
splitting them again, as the step does) is also timed alone, single-threaded like the runs,
over as many parameters as the model has, on the accelerator's device with the codec it picks
(C++ on CPU, the Triton kernel on CUDA / NPU where triton compiles, else the chunked PyTorch
codec; named in the row as codec_impl), and shown as a share of the baseline step.
    python benchmarks/bench_reuse_fp32_param.py [--iters 20] [--hidden 512] [--rounds 3]
    python benchmarks/bench_reuse_fp32_param.py --codec-only 709000000 --codec-impls triton device
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from harness import Bench  # noqa: E402
from launch import run_example  # noqa: E402


#: bytes a step's codec moves per master element: merge reads bf16 + residual (+ tie bits on a
#: device) and writes fp32; split reads fp32 and writes the residual (+ tie bits)
CODEC_BYTES_PER_PARAM = (2 + 2 + 4) + (4 + 2) + 2 / 8


def codec_ms_per_step(params: int, contiguous: bool, repeat: int = 5) -> tuple[float, str]:
    """materialize + release of SharedMasters over `params` elements on the accelerator's device
    in the model's layer shapes, fastest of `repeat` (on CPU single-threaded, as the runs are);
    `contiguous`: the bf16 values lie back to back in one buffer (the distributed optimizer's
    param buffer: a codec call per segment), else each has its own storage (a call per param).
    Returns (ms, the codec implementation that ran). The Bench made in main() has already given
    this process the runs' allocator (tracking + block cache)."""
    import time

    import torch

    from npuspeed import get_accelerator, telemetry
    from npuspeed.features.reuse_fp32_param import codec
    from npuspeed.features.reuse_fp32_param.shared_masters import SharedMasters

    acc = get_accelerator()
    device = acc.device()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        chunk = 1 << 20
        sizes = [min(chunk, params - i) for i in range(0, params, chunk)]
        mains = [torch.randn(n, device=device) * 0.02 for n in sizes]
        if contiguous:
            buffer = torch.empty(params, dtype=torch.bfloat16, device=device)
            models = list(torch.split(buffer, sizes))
            for model, main in zip(models, mains):
                model.copy_(main)
        else:
            models = [m.to(torch.bfloat16) for m in mains]
        shared = SharedMasters(list(zip(models, mains)))
        shared.release()
        before = telemetry.snapshot(codec.COUNTER)
        best = float("inf")
        for _ in range(repeat):
            acc.synchronize()
            t0 = time.perf_counter()
            shared.materialize()
            shared.release()
            acc.synchronize()
            best = min(best, time.perf_counter() - t0)
        ran = {k.rsplit(".", 1)[1] for k in telemetry.since(before, codec.COUNTER + "split.")}
        assert len(ran) == 1, ran
        return best * 1e3, ran.pop()
    finally:
        torch.set_num_threads(threads)


def codec_only(params: int, impls: list[str], contiguous: bool) -> list[dict]:
    """The codec alone at `params` masters, per implementation (forced through
    NPUSPEED_REUSE_CODEC): ms a step and GB/s, to compare with the device's memory bandwidth.
    Returns one record per implementation (what `--json` writes)."""
    import os

    from npuspeed import get_accelerator
    from npuspeed.features.reuse_fp32_param import codec

    device = get_accelerator().device().type
    records = []
    for impl in impls or [None]:
        if impl is not None:
            os.environ[codec.FORCE_ENV] = impl
        try:
            ms, ran = codec_ms_per_step(params, contiguous)
        finally:
            if impl is not None:
                os.environ.pop(codec.FORCE_ENV, None)
        gb_per_s = params * CODEC_BYTES_PER_PARAM / ms / 1e6
        print(f"[reuse_fp32_param codec] {device} {ran}: {params} masters, "
              f"{'one buffer' if contiguous else 'separate 1 Mi tensors'}: {ms:.2f} ms per step, {gb_per_s:.1f} GB/s")
        records.append({"device": device, "codec": ran, "forced": impl, "params": params, "one_buffer": contiguous,
                        "ms_per_step": ms, "gb_per_s": gb_per_s})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--codec-only", type=int, metavar="PARAMS", default=0,
                        help="time only the codec over PARAMS masters (no training runs)")
    parser.add_argument("--codec-impls", nargs="*", default=[], choices=["triton", "device", "cpp", "reference"],
                        help="with --codec-only: the implementations to time (default: the one picked)")
    parser.add_argument("--json", default=None, help="with --codec-only: write the timings there too")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", choices=["tp1", "dp2"], default=["tp1", "dp2"])
    opts = parser.parse_args()
    if opts.codec_only:
        Bench("reuse_fp32_param")  # the runs' allocator, as codec_ms_per_step expects
        records = [r for contiguous in (False, True) for r in codec_only(opts.codec_only, opts.codec_impls, contiguous)]
        if opts.json:
            Path(opts.json).write_text(json.dumps(records, indent=1))
        return
    model = ["--bf16", "--use-cpu-initialization", "--hidden-size", str(opts.hidden), "--num-layers",
             str(opts.layers), "--num-attention-heads", "8", "--seq-length", "256",
             "--micro-batch-size", "4", "--train-iters", str(opts.iters), "--log-interval", "100"]
    layouts = {"tp1": (1, []), "dp2 distributed optimizer": (2, ["--use-distributed-optimizer"])}
    layouts = {k: v for k, v in layouts.items() if k.split()[0] in opts.layouts}
    bench = Bench("reuse_fp32_param")
    with tempfile.TemporaryDirectory() as tmp:
        for case, (nproc, extra) in layouts.items():
            if not bench.ranks_fit(nproc):
                continue
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
            codec_ms, codec_impl = codec_ms_per_step(shard, contiguous=nproc > 1)
            row = bench.add(
                case, "bf16",
                baseline_ms=base_ms,
                feature_ms=min(r["median_step_ms"] for r in runs["reuse"]),
                baseline_peak_bytes=base["peak_mem_bytes"], feature_peak_bytes=reuse["peak_mem_bytes"],
                extra={"baseline_weight_bytes": base["weight_bytes"], "feature_weight_bytes": reuse["weight_bytes"],
                       "weight_ratio": round(reuse["weight_bytes"] / base["weight_bytes"], 4),
                       "hidden": opts.hidden, "layers": opts.layers, "iters": opts.iters,
                       "codec_ms_per_step": round(codec_ms, 2), "codec_impl": codec_impl,
                       "codec_GBps": round(shard * CODEC_BYTES_PER_PARAM / codec_ms / 1e6, 2),
                       "baseline_step_peak_bytes": base["optimizer_step_peak_bytes"],
                       "feature_step_peak_bytes": reuse["optimizer_step_peak_bytes"],
                       "step_peak_ratio": round(reuse["optimizer_step_peak_bytes"]
                                                / base["optimizer_step_peak_bytes"], 4),
                       "codec_share_of_step": round(codec_ms / base_ms, 4),
                       "run_medians_ms": {k: [round(r["median_step_ms"], 1) for r in v] for k, v in runs.items()}},
            )
            print(f"[reuse_fp32_param] {case}: weight bytes {base['weight_bytes']} -> {reuse['weight_bytes']} "
                  f"({row.extra['weight_ratio']:.3f}x), optimizer-step peak {row.extra['step_peak_ratio']:.4f}x, "
                  f"speed {row.speedup:.3f}x, bitwise losses; the codec alone ({codec_impl}) "
                  f"{codec_ms:.1f} ms per step = {100 * codec_ms / base_ms:.1f}% of the baseline step, "
                  f"{row.extra['codec_GBps']} GB/s")
    bench.finish()


if __name__ == "__main__":
    main()
