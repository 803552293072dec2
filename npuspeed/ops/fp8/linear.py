"""The FP8 linear: y = x W^T + b with its three GEMMs in FP8, as TE's Linear runs them.

forward  y  = Q(x) Q(W)^T              x: `input`, W: `weight` (forward format)
dgrad    dx = Q(dy) Q(W^T)^T           dy: `grad_output` (E5M2 under hybrid)
wgrad    dW = Q(dy^T) Q(x^T)^T         (fp32/bf16 instead when the recipe's wgrad_fp8 is off)

Each operand is quantized along its GEMM's contraction dimension (recipe.py). Per-tensor recipes
keep the FP8 x and W for backward (what TE saves); block recipes keep the transposed x's
quantization made in forward. `stats`, when given, is a dict the call adds its counts to:
GEMMs run and elements saturated / underflowed, per recipe.
"""
from __future__ import annotations

from typing import Optional

import torch

from npuspeed.ops.fp8.gemm import fp8_mm
from npuspeed.ops.fp8.recipe import Fp8Recipe


def _add(stats, recipe: Fp8Recipe, gemms: int, *quantized) -> None:
    if stats is None:
        return
    key = recipe.recipe
    stats[f"gemms.{key}"] = stats.get(f"gemms.{key}", 0) + gemms
    for q in quantized:
        stats["saturated"] = stats.get("saturated", 0) + int(q.saturated)
        stats["underflowed"] = stats.get("underflowed", 0) + int(q.underflowed)


def _transposed_for_gemm(recipe: Fp8Recipe, q, x2: torch.Tensor, role: str, state):
    """`x2.T` quantized along its last dimension: the transpose where scales allow, else again."""
    if recipe.per_tensor or (q.block is not None and q.block[0] == q.block[1]):
        return q.t()
    return recipe.quantize(x2.t(), role, state)


class Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe, state, stats: Optional[dict]):
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        qx = recipe.quantize(x2, "input", state)
        qw = recipe.quantize(weight, "weight", state)
        y = fp8_mm(qx, qw, x.dtype, recipe.backend)
        if bias is not None:
            y = y + bias
        _add(stats, recipe, 1, qx, qw)
        ctx.recipe, ctx.state, ctx.stats = recipe, state, stats
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        ctx.w_dtype = weight.dtype
        ctx.qw_t = _transposed_for_gemm(recipe, qw, weight, "weight", state)
        if recipe.wgrad_fp8:
            ctx.qx_t = _transposed_for_gemm(recipe, qx, x2, "input", state)
            ctx.save_for_backward()
        else:
            ctx.save_for_backward(x2)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        recipe, state, stats = ctx.recipe, ctx.state, ctx.stats
        n = dy.shape[-1]
        dy2 = dy.reshape(-1, n)
        qdy = recipe.quantize(dy2, "grad_output", state)
        dx = fp8_mm(qdy, ctx.qw_t, dy.dtype, recipe.backend)
        quantized, gemms = [qdy], 1
        if recipe.wgrad_fp8:
            qdy_t = _transposed_for_gemm(recipe, qdy, dy2, "grad_output", state)
            dw = fp8_mm(qdy_t, ctx.qx_t, ctx.w_dtype, recipe.backend)
            gemms += 1
            if qdy_t is not qdy and not recipe.per_tensor:
                quantized.append(qdy_t)
        else:
            (x2,) = ctx.saved_tensors
            dw = (dy2.float().t() @ x2.float()).to(ctx.w_dtype)
        _add(stats, recipe, gemms, *quantized)
        db = dy2.sum(0) if ctx.has_bias else None
        ctx.qw_t = ctx.qx_t = None
        return dx.reshape(ctx.x_shape), dw, db, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], recipe: Fp8Recipe,
               state=None, stats: Optional[dict] = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) with FP8 GEMMs; `state` from `recipe.new_state()`."""
    if recipe.recipe == "delayed" and state is None:
        raise ValueError("fp8_linear: the delayed recipe needs the linear's state (recipe.new_state())")
    return Fp8LinearFunction.apply(x, weight, bias, recipe, state, stats)
