"""RMSNorm in Triton: y = x * rsqrt(mean(x^2) + eps) * weight, and the variant fused with the
residual add before it (h = x + residual; y = rmsnorm(h)), forward and backward.

One program per row (the row sits in registers, BLOCK = next power of two of the width),
fp32 math, rounded once to the output dtype. Backward: each program handles ROWS consecutive
rows, writes dx and keeps its partial weight gradient in fp32; the [programs, N] partials are
summed afterwards (no atomics, the same result on every run). Semantics are
`npuspeed.ops.rms_norm.rms_norm_reference`'s; what the kernels do not take (fp64, rows wider
than 16384, a weight that is not 1-D of the row width) runs that reference.
"""
from __future__ import annotations

import torch

from npuspeed.ops.rms_norm import rms_norm_reference
from npuspeed.ops.triton import _runtime
from npuspeed.ops.triton._runtime import available  # noqa: F401  (public probe)

tl = None  # triton.language, bound by _runtime.kernels() on first use
PARTIAL_PROGRAMS = 256  # backward programs when the weight gradient is wanted (partials [256, N])


def _fwd(X, R, W, Y, H, RSTD, sx, sr, sy, sh, N, eps,
         HAS_W: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:  # h = x + residual, rounded to the activation dtype as the unfused add is
        r = tl.load(R + row * sr + cols, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(H.dtype.element_ty)
        tl.store(H + row * sh + cols, h, mask=mask)
        x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    y = x * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * sy + cols, y.to(Y.dtype.element_ty), mask=mask)


def _bwd(DY, X, W, RSTD, DH, DX, DWP, sdy, sx, sdh, sdx, M, N,
         HAS_W: tl.constexpr, HAS_DH: tl.constexpr, WANT_DW: tl.constexpr,
         ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        live = row < M
        m = cols < tl.where(live, N, 0)  # a block comparison: see _runtime's note on masks
        x = tl.load(X + row * sx + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * sdy + cols, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=live, other=0.0)
        xhat = x * rstd
        g = dy * w if HAS_W else dy
        dx = (g - xhat * (tl.sum(g * xhat, axis=0) / N)) * rstd
        if HAS_DH:  # the gradient of the residual output h joins the norm's
            dx += tl.load(DH + row * sdh + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(DX + row * sdx + cols, dx.to(DX.dtype.element_ty), mask=m)
        if WANT_DW:
            dw += dy * xhat
    if WANT_DW:
        tl.store(DWP + pid * N + cols, dw, mask=mask)


def _k():
    import sys

    return _runtime.kernels(sys.modules[__name__], ("_fwd", "_bwd"))


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _forward(x, residual, weight, eps, out_dtype):
    k = _k()
    x2 = _rows(x)
    m, n = x2.shape
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if residual is not None:
        r2 = _rows(residual)
        h = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        r2, h = x2, y
    blk = _runtime.block(n, _runtime.MAX_ROW)
    if m:
        k._fwd[(m,)](x2, r2, weight if weight is not None else x2, y, h, rstd,
                     x2.stride(0), r2.stride(0), y.stride(0), h.stride(0), n, float(eps),
                     HAS_W=weight is not None, HAS_RES=residual is not None, BLOCK=blk,
                     num_warps=_runtime.warps(blk))
    return y, (h if residual is not None else x2), rstd


def _backward(dy, xn, weight, rstd, dh, want_dw, x_dtype):
    """dx (in x_dtype, dh added when given) and the weight gradient (fp32) or None."""
    k = _k()
    dy2 = _rows(dy)
    m, n = xn.shape
    dx = torch.empty((m, n), dtype=x_dtype, device=xn.device)
    rows = _runtime.pow2(-(-m // PARTIAL_PROGRAMS)) if want_dw else 1
    programs = max(-(-m // rows), 1)
    partial = torch.empty((programs, n) if want_dw else (1,), dtype=torch.float32, device=xn.device)
    dh2 = _rows(dh) if dh is not None else dy2
    blk = _runtime.block(n, _runtime.MAX_ROW)
    if m:
        k._bwd[(programs,)](dy2, xn, weight if weight is not None else xn, rstd, dh2, dx, partial,
                            dy2.stride(0), xn.stride(0), dh2.stride(0), dx.stride(0), m, n,
                            HAS_W=weight is not None, HAS_DH=dh is not None, WANT_DW=want_dw,
                            ROWS=rows, BLOCK=blk, num_warps=_runtime.warps(blk))
    dw = None
    if want_dw:
        dw = partial.sum(0) if m else torch.zeros(n, dtype=torch.float32, device=xn.device)
    return dx, dw


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        out_dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
        y, xn, rstd = _forward(x, None, weight, eps, out_dtype)
        ctx.save_for_backward(xn, weight, rstd)
        ctx.shape, ctx.x_dtype = x.shape, x.dtype
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        xn, weight, rstd = ctx.saved_tensors
        want_dw = weight is not None and ctx.needs_input_grad[1]
        dx, dw = _backward(dy, xn, weight, rstd, None, want_dw, ctx.x_dtype)
        return dx.view(ctx.shape), (dw.to(weight.dtype) if want_dw else None), None


class _ResidualRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        out_dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
        y, h, rstd = _forward(x, residual, weight, eps, out_dtype)
        ctx.save_for_backward(h, weight, rstd)
        ctx.shape, ctx.x_dtype = x.shape, x.dtype
        return y.view(*x.shape[:-1], y.shape[-1]), h.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight, rstd = ctx.saved_tensors
        want_dw = weight is not None and ctx.needs_input_grad[2]
        dx, dw = _backward(dy, h, weight, rstd, dh, want_dw, ctx.x_dtype)
        dx = dx.view(ctx.shape)
        return dx, dx, (dw.to(weight.dtype) if want_dw else None), None


def supports(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether the kernels take this call (else the reference runs)."""
    tensors = (x,) if weight is None else (x, weight)
    return (x.dim() >= 1 and 0 < x.shape[-1] <= _runtime.MAX_ROW and _runtime.supported_dtype(*tensors)
            and (weight is None or (weight.dim() == 1 and weight.shape[0] == x.shape[-1])))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm of `x` over its last dimension, scaled by `weight` (1-D, or None for none)."""
    if not supports(x, weight):
        return rms_norm_reference(x, weight, eps)
    _runtime.check_runs_on("rms_norm", *((x,) if weight is None else (x, weight)))
    return _RMSNorm.apply(x, weight, float(eps))


def rms_norm_residual_reference(x, residual, weight, eps):
    """(rmsnorm(x + residual), x + residual): the add in the activation dtype, as unfused."""
    h = x + residual
    return rms_norm_reference(h, weight, eps), h


def rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                      eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) scaled by `weight`, x + residual) in one pass over the rows."""
    if (residual.shape != x.shape or residual.dtype != x.dtype or not supports(x, weight)):
        return rms_norm_residual_reference(x, residual, weight, eps)
    _runtime.check_runs_on("rms_norm", *((x, residual) if weight is None else (x, residual, weight)))
    return _ResidualRMSNorm.apply(x, residual, weight, float(eps))
