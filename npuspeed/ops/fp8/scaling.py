"""Scale factors from amaxes, as Transformer Engine defines them (scale: value -> FP8 range).

`current_scale` is TE's `compute_scale_from_amax` with epsilon 0 (Float8CurrentScaling, and
Float8BlockScaling with `pow2=True`): scale = max_fp8 / amax in fp32; an amax that is 0, Inf
or NaN gives scale 1; a scale that overflows fp32 becomes fp32's max; `pow2` rounds the scale
down to a power of two by clearing its mantissa bits. `delayed_scale` is DelayedScaling's:
(max_fp8 / amax) / 2**margin, keeping the previous scale where the amax is not a finite
positive number. `nan_amax` is the amax TE's kernels compute (fmaxf ignores NaN).
"""
from __future__ import annotations

import torch

FLT_MAX = torch.finfo(torch.float32).max
_MANTISSA_CLEAR = -(1 << 23)  # 0xFF800000 as int32: sign and exponent bits only


def nan_amax(x: torch.Tensor, dims=None) -> torch.Tensor:
    """max |x| over `dims` (all when None) in fp32, NaN elements ignored."""
    a = x.float().abs().nan_to_num(nan=0.0, posinf=float("inf"))
    return a.amax() if dims is None else a.amax(dim=dims)


def _usable(amax: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(amax) & (amax > 0)


def pow2_round_down(scale: torch.Tensor) -> torch.Tensor:
    return (scale.view(torch.int32) & _MANTISSA_CLEAR).view(torch.float32)


def current_scale(amax: torch.Tensor, fmax: float, *, pow2: bool = False) -> torch.Tensor:
    amax = amax.float()
    ones = torch.ones_like(amax)
    scale = torch.where(_usable(amax), torch.full_like(amax, fmax) / torch.where(_usable(amax), amax, ones), ones)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
    return pow2_round_down(scale) if pow2 else scale


def delayed_scale(amax: torch.Tensor, previous: torch.Tensor, fmax: float, margin: int) -> torch.Tensor:
    amax = amax.float()
    ok = _usable(amax)
    scale = (torch.full_like(amax, fmax) / torch.where(ok, amax, torch.ones_like(amax))) / (2.0 ** margin)
    scale = torch.where(ok, scale, previous.float())
    return torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """scale_inv = 1 / scale in fp32 (round to nearest), as TE stores it."""
    return torch.ones_like(scale) / scale
