"""torch's fused Adam vs Megatron's fallback Adam: one optimizer step on the example's parameters.

Without Transformer Engine and apex, megatron-core builds torch's AdamW (or Adam) with neither
`fused` nor `foreach`: torch then runs its for-loop path where parameters live on the CPU and its
foreach path on CUDA / NPU. The device layer builds it with `fused=True` where that wins
(npuspeed/features/device/fused_adam.py); this measures the choice.

The parameters are the shapes one rank holds in the end-to-end benchmark's model
(benchmarks/bench_e2e.py: 8 layers, hidden 512, SwiGLU ffn 1408, GQA 8/2 heads, byte-level
vocabulary padded to 384, untied output; `--tp 2` halves the sharded matrices), fp32 as the
optimizer sees them in a bf16 run (its fp32 masters). Both optimizers hold their own copy of
the same values and gradients; steps alternate (Megatron's, fused, Megatron's, ...) and each
pair gives one ratio, so a slow spell of a shared machine hits both. Prints the median step
time of each and the median and range of the per-pair ratio.
    python benchmarks/bench_fused_adam.py [--tp 1] [--layers 8] [--pairs 30] [--adam]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Bench  # noqa: E402


def shapes(layers: int, hidden: int, ffn: int, heads: int, groups: int, vocab: int, tp: int) -> list[tuple]:
    """One rank's parameter shapes of the Llama-style example model (Megatron's local spec)."""
    kv = hidden // heads * groups
    per_layer = [(hidden,), ((hidden + 2 * kv) // tp, hidden), (hidden, hidden // tp), (hidden,),
                 (2 * ffn // tp, hidden), (hidden, ffn // tp)]
    return [(vocab // tp, hidden)] + per_layer * layers + [(hidden,), (vocab // tp, hidden)]


def build(cls, fused: bool, shape_list, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shape_list]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    kwargs = dict(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    return cls(params, fused=True, **kwargs) if fused else cls(params, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--adam", action="store_true", help="torch.optim.Adam (--no-decoupled-weight-decay)")
    opts = parser.parse_args()
    import torch

    bench = Bench("fused_adam", warmup=2, repeat=opts.pairs)
    cls = torch.optim.Adam if opts.adam else torch.optim.AdamW
    shape_list = shapes(opts.layers, 512, 1408, 8, 2, 384, opts.tp)
    megatron, fused = build(cls, False, shape_list), build(cls, True, shape_list)
    for _ in range(bench.warmup):
        megatron.step()
        fused.step()
    a, b = [], []
    for _ in range(bench.repeat):
        for opt, out in ((megatron, a), (fused, b)):
            start = time.perf_counter()
            opt.step()
            out.append((time.perf_counter() - start) * 1e3)
    ratios = sorted(x / y for x, y in zip(a, b))
    numel = sum(p.numel() for g in megatron.param_groups for p in g["params"])
    extra = {"params": numel, "tensors": len(shape_list), "threads": torch.get_num_threads(), "tp": opts.tp,
             "ratio_median": statistics.median(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1],
             "class": cls.__name__}
    bench.add(f"{cls.__name__} step, {numel / 1e6:.1f}M fp32 params in {len(shape_list)} tensors", "fp32",
              baseline_ms=statistics.median(a), feature_ms=statistics.median(b), extra=extra)
    print(f"[fused_adam] {cls.__name__} {numel / 1e6:.1f}M params, {torch.get_num_threads()} threads: Megatron's "
          f"(for-loop on CPU) median {statistics.median(a):.1f} ms, fused median {statistics.median(b):.1f} ms; "
          f"per-pair speedup median {statistics.median(ratios):.2f}x (range {ratios[0]:.2f}-{ratios[-1]:.2f}, "
          f"{len(ratios)} pairs)", flush=True)
    bench.finish()


if __name__ == "__main__":
    main()
