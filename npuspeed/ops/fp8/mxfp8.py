"""MXFP8 (Megatron's `--fp8-recipe mxfp8`): OCP Microscaling v1.0, 32 consecutive elements along
the contraction dimension share one E8M0 (power-of-two) scale X.

Per the spec (section 6.3): X = 2**(floor(log2(amax)) - emax_elem), emax_elem the exponent of
the element format's largest normal (8 for E4M3, 15 for E5M2); elements are V / X cast to the
element format, saturating. E8M0 spans 2**-127..2**127: a smaller X (all-zero or tiny blocks)
is 2**-127. A block whose amax is Inf has no power-of-two scale: its scale is E8M0's NaN (0xFF)
and every element decodes as NaN; a NaN element stays NaN and does not enter the amax (as TE's
kernels compute it). TE's own MXFP8 rounds the exponent up instead (amax / max, ceil), so it
never saturates; this follows the OCP definition the issue names.
"""
from __future__ import annotations

import torch

from npuspeed.ops.fp8.cast import block_grid, expand_blocks, scaled_cast
from npuspeed.ops.fp8.formats import Fp8Format
from npuspeed.ops.fp8.quantized import Fp8Tensor
from npuspeed.ops.fp8.scaling import nan_amax

MX_BLOCK = 32
E8M0_BIAS, E8M0_NAN = 127, 255


def mx_exponents(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Unbiased shared exponent per block (int32), NaN blocks marked by E8M0_NAN - E8M0_BIAS."""
    _, e = torch.frexp(amax)                   # amax = m * 2**e, m in [0.5, 1): floor(log2) = e - 1
    x = (e - 1 - fmt.emax).clamp(-E8M0_BIAS, E8M0_BIAS)
    x = torch.where(amax > 0, x, torch.full_like(x, -E8M0_BIAS))
    return torch.where(torch.isinf(amax), torch.full_like(x, E8M0_NAN - E8M0_BIAS), x)


def quantize_mxfp8(x: torch.Tensor, fmt: Fp8Format) -> Fp8Tensor:
    if x.dim() != 2:
        raise ValueError(f"MXFP8 quantization takes a 2-D tensor, got shape {tuple(x.shape)}")
    block = (1, MX_BLOCK)
    amax = nan_amax(block_grid(x, block), dims=(1, 3))
    exp = mx_exponents(amax, fmt)
    nan_block = exp == E8M0_NAN - E8M0_BIAS
    scale_inv = torch.where(nan_block, torch.full_like(amax, float("nan")),
                            torch.exp2(exp.float()))
    scale = torch.where(nan_block, torch.full_like(amax, float("nan")), torch.exp2(-exp.float()))
    q, sat, under = scaled_cast(x, expand_blocks(scale, block, x.shape), fmt)
    e8m0 = (exp + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)
    return Fp8Tensor(q, scale_inv, fmt, block, sat, under, e8m0)
