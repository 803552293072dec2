"""Gradient-accumulation fusion end to end: the example with and without the flag.

    python benchmarks/bench_grad_accum_fusion.py [--hidden 512] [--layers 4] [--seq 512] [--repeats 2]

A GPT (ffn 4 x hidden, dropout 0) at TP1 trains --iters iterations of global batch 8 in
micro-batches of 2 (four weight-gradient accumulations per step) through
examples/pretrain_gpt.py, fp32 and bf16, without and with --gradient-accumulation-fusion,
alternating --repeats times (which goes first alternates too); the best tokens/s of each counts (the machine is shared). The
flag's runs choose their path per shape as a user's would (no NPUSPEED_WGRAD_PATH). Rows
go to benchmarks/results/<device>.csv: time per token and forward_backward_peak_bytes.
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
from launch import NO_DROPOUT, run_example  # noqa: E402

FLAG = "--gradient-accumulation-fusion"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    opts = parser.parse_args()
    args = NO_DROPOUT + ["--use-cpu-initialization", "--num-layers", str(opts.layers), "--hidden-size",
                         str(opts.hidden), "--num-attention-heads", "8", "--seq-length", str(opts.seq),
                         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(opts.iters),
                         "--log-interval", "1"]
    bench = Bench("grad_accum_fusion")
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in opts.dtypes:
            extra = ["--bf16"] if dtype == "bf16" else []
            best = {False: None, True: None}
            for r in range(opts.repeats):
                for on in ((False, True) if r % 2 == 0 else (True, False)):  # order alternates too
                    got = run_example(args + extra + ([FLAG] if on else []), Path(tmp), name=f"{dtype}{on}{r}")
                    if best[on] is None or got["tokens_per_s"] > best[on]["tokens_per_s"]:
                        best[on] = got
            base, feat = best[False], best[True]
            ratio = feat["tokens_per_s"] / base["tokens_per_s"]
            print(f"[grad_accum_fusion] {dtype}: tokens/s {base['tokens_per_s']:.0f} -> {feat['tokens_per_s']:.0f} "
                  f"(x{ratio:.3f}); forward_backward_peak_bytes {base['forward_backward_peak_bytes']} -> "
                  f"{feat['forward_backward_peak_bytes']} "
                  f"({feat['forward_backward_peak_bytes'] - base['forward_backward_peak_bytes']:+d})", flush=True)
            bench.add(f"h{opts.hidden}_l{opts.layers}_s{opts.seq}_tp1", dtype,
                      baseline_ms=1e3 / base["tokens_per_s"], feature_ms=1e3 / feat["tokens_per_s"],
                      baseline_peak_bytes=base["forward_backward_peak_bytes"],
                      feature_peak_bytes=feat["forward_backward_peak_bytes"],
                      extra={"unit": "ms per token", "repeats": opts.repeats, "tokens_per_s_ratio": round(ratio, 4)})
    bench.finish()


if __name__ == "__main__":
    main()
