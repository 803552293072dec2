"""The FP8 linear: y = x W^T + b with its three GEMMs in FP8, as TE's Linear runs them.

forward  y  = Q(x) Q(W)^T              x: `input`, W: `weight` (forward format)
dgrad    dx = Q(dy) Q(W^T)^T           dy: `grad_output` (E5M2 under hybrid)
wgrad    dW = Q(dy^T) Q(x^T)^T         (fp32 instead when the recipe's wgrad_fp8 is off)

Each operand is quantized along its GEMM's contraction dimension (recipe.py). Per-tensor recipes
keep the FP8 x and W for backward (what TE saves); block recipes keep the transposed x's
quantization made in forward. `fp8_forward` / `fp8_backward` are the two halves, for autograd
functions that add communication around them (the fp8 feature's tensor-parallel linear);
`fp8_linear` is the plain one. `count(name, n)`, when given, receives: `gemm.<recipe>` per GEMM,
`saturated` and `underflowed` elements per quantization.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from npuspeed.ops.fp8.gemm import fp8_mm
from npuspeed.ops.fp8.quantized import Fp8Tensor
from npuspeed.ops.fp8.recipe import Fp8Recipe

Count = Optional[Callable[[str, int], None]]


def _count(count: Count, recipe: Fp8Recipe, gemms: int, *quantized: Fp8Tensor) -> None:
    if count is None:
        return
    count(f"gemm.{recipe.recipe}", gemms)
    sat = sum(int(q.saturated) for q in quantized)
    under = sum(int(q.underflowed) for q in quantized)
    if sat:
        count("saturated", sat)
    if under:
        count("underflowed", under)


def _transposed_for_gemm(recipe: Fp8Recipe, q: Fp8Tensor, x2: torch.Tensor, role: str, state):
    """`x2.T` quantized along its last dimension: the transpose where scales allow, else again."""
    if recipe.per_tensor or (q.block is not None and q.block[0] == q.block[1]):
        return q.t(), False
    return recipe.quantize(x2.t(), role, state), True


@dataclass
class Fp8Saved:
    """What backward needs: W^T quantized for dgrad, x^T quantized (or x itself) for wgrad."""
    recipe: Fp8Recipe
    state: object
    count: Count
    qw_t: Fp8Tensor
    qx_t: Optional[Fp8Tensor]
    x_hp: Optional[torch.Tensor]


def fp8_forward(x2: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe, state=None,
                count: Count = None) -> tuple[torch.Tensor, Fp8Saved]:
    """x2 [M, K] @ weight [N, K]^T in FP8 (no bias), and what backward keeps."""
    qx = recipe.quantize(x2, "input", state)
    qw = recipe.quantize(weight, "weight", state)
    y = fp8_mm(qx, qw, x2.dtype, recipe.backend)
    qw_t, w_again = _transposed_for_gemm(recipe, qw, weight, "weight", state)
    extra = [qw_t] if w_again else []
    if recipe.wgrad_fp8:
        qx_t, x_again = _transposed_for_gemm(recipe, qx, x2, "input", state)
        extra += [qx_t] if x_again else []
        saved = Fp8Saved(recipe, state, count, qw_t, qx_t, None)
    else:
        saved = Fp8Saved(recipe, state, count, qw_t, None, x2)
    _count(count, recipe, 1, qx, qw, *extra)
    return y, saved


def fp8_backward(dy2: torch.Tensor, saved: Fp8Saved, dw_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [M, K], dW [N, K] in `dw_dtype`) from dy2 [M, N]."""
    recipe, state = saved.recipe, saved.state
    qdy = recipe.quantize(dy2, "grad_output", state)
    dx = fp8_mm(qdy, saved.qw_t, dy2.dtype, recipe.backend)
    quantized, gemms = [qdy], 1
    if saved.qx_t is not None:
        qdy_t, again = _transposed_for_gemm(recipe, qdy, dy2, "grad_output", state)
        dw = fp8_mm(qdy_t, saved.qx_t, dw_dtype, recipe.backend)
        gemms += 1
        quantized += [qdy_t] if again else []
    else:
        dw = (dy2.float().t() @ saved.x_hp.float()).to(dw_dtype)
    _count(saved.count, recipe, gemms, *quantized)
    return dx, dw


class Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe, state, count: Count):
        x2 = x.reshape(-1, x.shape[-1])
        y, ctx.saved = fp8_forward(x2, weight, recipe, state, count)
        if bias is not None:
            y = y + bias
        ctx.x_shape, ctx.has_bias, ctx.w_dtype = x.shape, bias is not None, weight.dtype
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx, dw = fp8_backward(dy2, ctx.saved, ctx.w_dtype)
        ctx.saved = None
        db = dy2.sum(0) if ctx.has_bias else None
        return dx.reshape(ctx.x_shape), dw, db, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], recipe: Fp8Recipe,
               state=None, count: Count = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) with FP8 GEMMs; `state` from `recipe.new_state()`."""
    if recipe.recipe == "delayed" and state is None:
        raise ValueError("fp8_linear: the delayed recipe needs the linear's state (recipe.new_state())")
    return Fp8LinearFunction.apply(x, weight, bias, recipe, state, count)
