"""Fused RMSNorm / SwiGLU / RoPE vs the eager PyTorch Megatron runs, forward + backward.

    python benchmarks/bench_fused_ops.py [--repeat N] [--warmup N] [--tokens 4096] [--quick]

Baselines are what Megatron-Core runs without the flags: torch.nn.RMSNorm (WrappedTorchNorm),
silu(a) * b on torch.chunk halves (MLP's unfused GLU), and Megatron's own
`_apply_rotary_pos_emb_bshd`. Features: `npuspeed.ops` front ends, which on CPU run the C++
kernels (the run stops if they are not loaded, so a fallback cannot be timed as "fused").
Shapes: 4096 tokens x hidden 4096, x ffn 11008 (input 2 x 11008), RoPE [4096, 1, 32, 128];
fp32 and bf16. Results: benchmarks/results/<device>.csv and fused_ops_<device>.png.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Bench  # noqa: E402


def fwd_bwd(fn, *inputs):
    """One step: forward, backward of a fixed random cotangent, inputs' grads dropped."""
    out = fn()
    out.backward(_cotangent(out))
    for t in inputs:
        t.grad = None


_COT: dict = {}


def _cotangent(out):
    key = (tuple(out.shape), out.dtype)
    if key not in _COT:
        _COT[key] = torch.randn(out.shape, dtype=out.dtype)
    return _COT[key]


def rope_freqs(seq: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Megatron's RotaryEmbedding angles: [s, 1, 1, dim], rotate-half layout, fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, two repeats (smoke test)")
    parser.add_argument("--results-dir", default=None, help="default: benchmarks/results")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.hidden, args.ffn, args.heads, args.repeat, args.warmup = 64, 256, 512, 4, 2, 2

    bench = Bench("fused_ops", warmup=args.warmup, repeat=args.repeat, results_dir=args.results_dir)  # enables memory tracking first

    from megatron.core.models.common.embeddings import rope_utils

    from npuspeed.ops import _dispatch
    from npuspeed.ops.rms_norm import rms_norm
    from npuspeed.ops.rope import rotary_pos_emb
    from npuspeed.ops.swiglu import swiglu

    for op in ("rms_norm", "swiglu", "rotary_pos_emb"):
        if _dispatch.implementation(op, torch.empty(1)) != "cpp":
            raise SystemExit(f"bench_fused_ops: the C++ op {op} is not loaded on this machine; nothing to compare")

    torch.manual_seed(0)
    n, h, f = args.tokens, args.hidden, args.ffn
    threads = torch.get_num_threads()
    for name in args.dtypes.split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        extra = {"threads": threads}

        norm = torch.nn.RMSNorm(h, eps=1e-5, dtype=dtype)
        x = torch.randn(n, h, dtype=dtype, requires_grad=True)
        bench.compare(
            f"rmsnorm {n}x{h}", name, extra={**extra, "shape": [n, h]},
            baseline=lambda: fwd_bwd(lambda: norm(x), x, norm.weight),
            feature=lambda: fwd_bwd(lambda: rms_norm(x, norm.weight, 1e-5), x, norm.weight),
        )
        del x, norm

        y = torch.randn(n, 2 * f, dtype=dtype, requires_grad=True)

        def eager_swiglu():
            a, b = torch.chunk(y, 2, dim=-1)
            return F.silu(a) * b

        bench.compare(
            f"swiglu {n}x{f}", name, extra={**extra, "shape": [n, 2 * f]},
            baseline=lambda: fwd_bwd(eager_swiglu, y),
            feature=lambda: fwd_bwd(lambda: swiglu(y), y),
        )
        del y

        t = torch.randn(n, 1, args.heads, args.head_dim, dtype=dtype, requires_grad=True)
        freqs = rope_freqs(n, args.head_dim)
        bench.compare(
            f"rope {n}x1x{args.heads}x{args.head_dim}", name, extra={**extra, "shape": list(t.shape)},
            baseline=lambda: fwd_bwd(lambda: rope_utils._apply_rotary_pos_emb_bshd(t, freqs), t),
            feature=lambda: fwd_bwd(lambda: rotary_pos_emb(t, freqs), t),
        )
        del t

    calls = {f"{op}:{impl}": c for (op, impl), c in _dispatch.calls().items()}
    print(f"implementations that ran: {calls}")
    bench.finish()


if __name__ == "__main__":
    main()
