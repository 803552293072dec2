"""SwiGLU in Triton, Megatron's layout: x [..., 2F] -> silu(x[..., :F]) * x[..., F:].

The gate is the first half, as megatron.core.fusions.fused_bias_swiglu.swiglu chunks it.
Elementwise over [rows, F] blocks; fp32 math, rounded once. Backward recomputes the sigmoid
from the saved input (nothing but x is kept) and writes both halves of dx in one pass:
d gate = g * b * s * (1 + a * (1 - s)), d up = g * a * s, with s = sigmoid(a).
Semantics are `npuspeed.ops.swiglu.swiglu_reference`'s; fp64 runs that reference.
"""
from __future__ import annotations

import torch

from npuspeed.ops.swiglu import swiglu_reference
from npuspeed.ops.triton import _runtime
from npuspeed.ops.triton._runtime import available  # noqa: F401  (public probe)

tl = None  # triton.language, bound by _runtime.kernels() on first use
BLOCK_CAP = 1024


def _fwd(X, Y, sx, sy, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    a = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + row * sx + F + cols, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-a))
    tl.store(Y + row * sy + cols, (a * s * b).to(Y.dtype.element_ty), mask=mask)


def _bwd(G, X, DX, sg, sx, sdx, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(G + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + row * sx + F + cols, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-a))
    tl.store(DX + row * sdx + cols, (g * b * s * (1.0 + a * (1.0 - s))).to(DX.dtype.element_ty), mask=mask)
    tl.store(DX + row * sdx + F + cols, (g * a * s).to(DX.dtype.element_ty), mask=mask)


def _k():
    import sys

    return _runtime.kernels(sys.modules[__name__], ("_fwd", "_bwd"))


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _grid(m: int, f: int):
    blk = _runtime.block(f, BLOCK_CAP)
    return (m, -(-f // blk)), blk


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x2 = _rows(x)
        m, f = x2.shape[0], x2.shape[1] // 2
        y = torch.empty((m, f), dtype=x.dtype, device=x.device)
        if m and f:
            grid, blk = _grid(m, f)
            _k()._fwd[grid](x2, y, x2.stride(0), y.stride(0), f, BLOCK=blk, num_warps=_runtime.warps(blk))
        ctx.save_for_backward(x2)
        ctx.shape = x.shape
        return y.view(*x.shape[:-1], f)

    @staticmethod
    def backward(ctx, g):
        (x2,) = ctx.saved_tensors
        g2 = _rows(g)
        m, f = g2.shape
        dx = torch.empty_like(x2, memory_format=torch.contiguous_format)
        if m and f:
            grid, blk = _grid(m, f)
            _k()._bwd[grid](g2, x2, dx, g2.stride(0), x2.stride(0), dx.stride(0), f, BLOCK=blk,
                            num_warps=_runtime.warps(blk))
        return dx.view(ctx.shape)


def supports(x: torch.Tensor) -> bool:
    return _runtime.supported_dtype(x)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] on the last dimension (which must be even)."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dimension must be even (gate and linear halves), got {tuple(x.shape)}")
    if not supports(x):
        return swiglu_reference(x)
    _runtime.check_runs_on("swiglu", x)
    return _SwiGLU.apply(x)
