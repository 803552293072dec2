"""Fused linear cross-entropy benchmark: the GPT head (output matmul + vocab-parallel CE, forward +
backward) as Megatron runs it vs --use-fused-linear-cross-entropy's tiles.

    python benchmarks/bench_fused_linear_ce.py [--cases 1024x64x65536 1024x512x32768] [--dtypes fp32 bf16]
    python benchmarks/bench_fused_linear_ce.py --e2e [--layouts tp1 tp2 tp2sp] [--rounds 3] [--iters 12]

Case TOKENSxHIDDENxVOCAB on a 1-rank gloo group. Baseline: `matmul(h, W^T)` then Megatron's
`vocab_parallel_cross_entropy`, backward with a per-token gradient; feature: the chunked
function with the default tile. Besides the harness's wall-time median and step peaks, the
median of the process CPU time is reported (`cpu_speedup`): on a shared CPU host the wall time
moves with other load. `auto_picks` is the path --fused-linear-cross-entropy-fallback auto
takes at that shape (its own once-per-shape trial).

`--e2e`: the issue's acceptance case, whole training steps of examples/pretrain_gpt.py with a 64k
vocabulary (fused_linear_ce_steps.py), flag off and on alternating for --rounds rounds per layout (TP1, TP2,
TP2 + sequence parallel) and dtype. The speed figure is tokens per CPU-second of the step: the
sum over ranks of each rank's median step CPU time (`median_step_cpu_ms_per_rank`, first
iteration left out). Taking the process CPU time of whole runs instead (long run minus short
run) leaves each run's start-up in the difference: on this host that moved identical runs by
up to 25%.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from harness import Bench, init_single_rank_megatron

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(tokens, hidden, vocab, dtype):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, 1, hidden, generator=gen).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(dtype)
    labels = torch.randint(0, vocab, (tokens, 1), generator=gen)
    g = torch.rand(tokens, 1, generator=gen) / tokens
    return h, w, labels, g


def _steps(h, w, labels, g):
    from megatron.core import tensor_parallel

    from npuspeed.features.fused_linear_ce.function import linear_cross_entropy

    def megatron():
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        tensor_parallel.vocab_parallel_cross_entropy(torch.matmul(hh, ww.t()), labels).backward(g)

    def chunked():
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        linear_cross_entropy(hh, ww, labels).backward(g)

    return megatron, chunked


def _cpu_speedup(baseline, feature, repeat: int) -> float:
    base, feat = [], []
    for _ in range(repeat):
        for fn, out in ((baseline, base), (feature, feat)):
            start = time.process_time()
            fn()
            out.append(time.process_time() - start)
    return statistics.median(base) / statistics.median(feat)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", default=["1024x64x65536", "1024x512x32768"])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    parser.add_argument("--e2e", action="store_true", help="whole training steps of the example (fused_linear_ce_steps.py)")
    parser.add_argument("--layouts", nargs="+", default=["tp1", "tp2", "tp2sp"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--fallback", choices=["never", "auto"], default="never")
    args = parser.parse_args()
    if args.e2e:
        from fused_linear_ce_steps import run_layouts

        run_layouts(args)
        return
    state = init_single_rank_megatron(["--use-fused-linear-cross-entropy"])
    from npuspeed.features.fused_linear_ce.candidates import LossPaths

    bench = Bench("fused_linear_ce", warmup=1, repeat=5)
    for case in args.cases:
        tokens, hidden, vocab = (int(x) for x in case.split("x"))
        for name in args.dtypes:
            h, w, labels, g = _inputs(tokens, hidden, vocab, DTYPES[name])
            megatron, chunked = _steps(h, w, labels, g)
            chooser = LossPaths("auto")
            picks = chooser.choose(tokens, h, w, None, state.accelerator)
            row = bench.compare(case, name, baseline=megatron, feature=chunked,
                                extra={"auto_picks": picks, "trial": chooser.choices[chooser.key(tokens, h, w)]["why"]})
            row.extra["cpu_speedup"] = round(_cpu_speedup(megatron, chunked, bench.repeat), 3)
            print(f"  {case} {name}: mem ratio {row.mem_ratio:.3f}, wall x{row.speedup:.2f}, "
                  f"cpu x{row.extra['cpu_speedup']:.2f}, auto picks {picks}", flush=True)
    bench.finish()


if __name__ == "__main__":
    main()
