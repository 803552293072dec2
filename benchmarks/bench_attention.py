"""Fused attention benchmark: Megatron's DotProductAttention unfused vs --use-flash-attn.

    python benchmarks/bench_attention.py [--seq-lengths 1024 2048] [--dtypes fp32 bf16] [--dropouts 0 0.1]

One step = forward + backward of one causal DotProductAttention layer (b=1, 8 heads, d=64)
on the accelerator npuspeed picks (a 1-rank gloo group on CPU, nccl / hccl on a device), in
training mode, without dropout and with Megatron's default attention dropout 0.1 (drawn inside
the model-parallel RNG tracker on both sides). Baseline is Megatron's own forward (the
registry's original), the feature is the patched one; both run on the same module and inputs in one process, through
the shared harness (interleaved timing, peak memory, CSV + PNG under benchmarks/results/).
Where npuspeed's CPU kernel runs, one more row (no dropout) measures it against PyTorch's
scaled_dot_product_attention on the same layer.
"""
from __future__ import annotations

import argparse
import os

import torch

from harness import Bench, init_single_rank_megatron

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGET = "megatron.core.transformer.dot_product_attention.DotProductAttention.forward"


def _init_megatron():
    return init_single_rank_megatron(["--use-flash-attn"])


def _layer(heads: int, d: int, dtype: torch.dtype, dropout: float = 0.0):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads, kv_channels=d,
                            attention_dropout=dropout, use_cpu_initialization=True,
                            bf16=dtype == torch.bfloat16, params_dtype=dtype)
    return DotProductAttention(cfg, 1, AttnMaskType.causal, "self").train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--dropouts", type=float, nargs="+", default=[0.0, 0.1],
                        help="attention dropout (0.1 is Megatron's default)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    bench = Bench("attention", warmup=args.warmup, repeat=args.repeat)
    _init_megatron()
    from npuspeed.features.fused_attention import kernel_calls
    from npuspeed.features.fused_attention.forward import CPU_FLASH, CPU_FLASH_FP32
    from npuspeed.patching import registry

    unfused_forward = registry.original(TARGET)
    for dtype_name, p in [(n, p) for p in args.dropouts for n in args.dtypes]:
        dtype = DTYPES[dtype_name]
        layer = _layer(args.heads, args.head_dim, dtype, p).to(bench.device)
        tag = f" dropout {p:g}" if p else ""
        for s in args.seq_lengths:
            gen = torch.Generator().manual_seed(s)
            shape = (s, args.batch, args.heads, args.head_dim)
            q, k, v = (torch.randn(*shape, generator=gen).to(bench.device, dtype).requires_grad_(True)
                       for _ in range(3))
            grad = torch.randn(s, args.batch, args.heads * args.head_dim, generator=gen).to(bench.device, dtype)

            def step(forward):
                def run():
                    for t in (q, k, v):
                        t.grad = None
                    forward(q, k, v, None).backward(grad)
                return run

            calls = kernel_calls()
            row = bench.compare(
                f"causal S={s}{tag}", dtype_name,
                baseline=step(lambda *a: unfused_forward(layer, *a)), feature=step(layer),
                extra={"S": s, "b": args.batch, "heads": args.heads, "d": args.head_dim, "dropout": p,
                       "threads": torch.get_num_threads(), "torch": torch.__version__},
            )
            ran = {k_: n - calls.get(k_, 0) for k_, n in kernel_calls().items() if n != calls.get(k_, 0)}
            assert ran, "the fused path never ran"
            row.extra["kernel"] = ",".join(sorted(ran))
            ours = {CPU_FLASH, CPU_FLASH_FP32} & set(ran)
            if ours and not p:  # npuspeed's own kernel: also against PyTorch's SDPA (its flash kernel)
                bench.compare(f"causal S={s} vs SDPA", dtype_name, baseline=step(sdpa_only(layer)),
                              feature=step(layer), extra={"S": s, "kernel": ours.pop(), "baseline": "sdpa"})
    bench.finish()


def sdpa_only(layer):
    """The layer on PyTorch's SDPA (what --use-flash-attn ran before npuspeed's CPU kernel)."""
    import functools

    from npuspeed.features.fused_attention.masks import MaskPlan
    from npuspeed.features.fused_attention.sdpa import sdpa_attention

    def forward(q, k, v, _mask):
        return sdpa_attention(q, k, v, MaskPlan(causal=True), scale=layer.softmax_scale, dropout_p=0.0)

    return functools.partial(forward)

    return forward


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    main()
