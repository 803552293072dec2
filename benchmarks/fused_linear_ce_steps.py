"""`bench_fused_linear_ce.py --e2e`: whole training steps with and without the flag.

The example (examples/pretrain_gpt.py) with the issue's 64k vocabulary (NullTokenizer, vocab
65535 padded to 65536, hidden 64, 1 layer, S 256, micro-batch 4, dropout 0), flag off and on
alternating (the order flips each round) so that the host's other load falls on both. Per run:
the sum over ranks of each rank's median step CPU time (tokens per CPU-second is its inverse:
the whole host's work for one step, steadier than wall time on a shared machine), the losses,
the forward/backward peak. Per layout and dtype: the ratio of the medians, each round's ratio
(spread), the largest loss difference, the peak ratio and the load average seen.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from harness import Bench  # noqa: E402
from launch import NO_DROPOUT, TINY, run_example  # noqa: E402

VOCAB64K = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "65535", "--hidden-size", "64", "--num-layers", "1",
            "--num-attention-heads", "4", "--seq-length", "256", "--micro-batch-size", "4", "--global-batch-size", "4"]
LAYOUTS = {"tp1": (1, []), "tp2": (2, []), "tp2sp": (2, ["--sequence-parallel"])}
DTYPE_FLAGS = {"fp32": [], "bf16": ["--bf16"]}


def _step_cpu_ms(summary: dict) -> float:
    return sum(summary["median_step_cpu_ms_per_rank"])


def run_layouts(args) -> None:
    bench = Bench("fused_linear_ce_e2e")
    flag = ["--use-fused-linear-cross-entropy", "--fused-linear-cross-entropy-fallback", args.fallback]
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            for layout in args.layouts:
                nproc, extra = LAYOUTS[layout]
                base = TINY + NO_DROPOUT + VOCAB64K + DTYPE_FLAGS[dtype] + [
                    "--train-iters", str(args.iters), "--tensor-model-parallel-size", str(nproc)] + extra
                runs, loads = {"off": [], "on": []}, []
                for r in range(args.rounds):
                    order = [("off", base), ("on", base + flag)]
                    for name, argv in order if r % 2 == 0 else order[::-1]:
                        runs[name].append(run_example(argv, tmp, nproc=nproc, name=name, timeout=900))
                        loads.append(os.getloadavg()[0])
                off, on = ([_step_cpu_ms(s) for s in runs[k]] for k in ("off", "on"))
                rounds = [a / b for a, b in zip(off, on)]
                diff = max(abs(a - b) for a, b in zip(runs["off"][0]["losses"], runs["on"][0]["losses"]))
                peak_off, peak_on = runs["off"][0]["forward_backward_peak_bytes"], runs["on"][0]["forward_backward_peak_bytes"]
                counters = runs["on"][0].get("npuspeed_counters", {})
                fell_back = {k: v for k, v in counters.items() if k.startswith("fused_linear_ce.fallback.")}
                extra_cols = {"layout": layout, "rounds": args.rounds, "iters": args.iters, "fallback": args.fallback,
                              "cpu_ratio_rounds": [round(x, 3) for x in rounds], "max_loss_diff": diff,
                              "load": [round(min(loads), 1), round(max(loads), 1)],
                              "rank0_fallbacks": fell_back}
                row = bench.add(f"e2e {layout} 1024x64x65536", dtype, baseline_ms=statistics.median(off),
                                feature_ms=statistics.median(on), baseline_peak_bytes=peak_off,
                                feature_peak_bytes=peak_on, extra=extra_cols)
                print(f"  {layout} {dtype}: tokens per CPU-second x{row.speedup:.3f} (rounds {min(rounds):.3f}-"
                      f"{max(rounds):.3f}; step CPU ms off {statistics.median(off):.0f} [{min(off):.0f}-{max(off):.0f}], "
                      f"on {statistics.median(on):.0f} [{min(on):.0f}-{max(on):.0f}]), loss diff {diff:.2e}, "
                      f"fwd/bwd peak {row.mem_ratio:.3f}x, load {min(loads):.1f}-{max(loads):.1f}"
                      f"{', rank 0 fell back: ' + str(fell_back) if fell_back else ''}", flush=True)
    bench.finish()
