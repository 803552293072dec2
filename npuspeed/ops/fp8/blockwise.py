"""Blockwise scaling (Megatron's `--fp8-recipe blockwise`, TE's Float8BlockScaling, DeepSeek-V3's
recipe): one fp32 scale per 1x128 tile of activations and gradients (along the GEMM's
contraction dimension) and per 128x128 block of weights.

Each block's scale is TE's current scale of the block's amax with power-of-two scales (TE's
default for this recipe: the scale's mantissa cleared), so decoding is exact. Edge blocks are
partial (the tensor is zero-padded to whole blocks and cropped back).
"""
from __future__ import annotations

import torch

from npuspeed.ops.fp8.cast import block_grid, expand_blocks, scaled_cast
from npuspeed.ops.fp8.formats import Fp8Format
from npuspeed.ops.fp8.quantized import Fp8Tensor
from npuspeed.ops.fp8.scaling import current_scale, nan_amax, reciprocal

ACTIVATION_BLOCK = (1, 128)
WEIGHT_BLOCK = (128, 128)


def quantize_blockwise(x: torch.Tensor, fmt: Fp8Format, block: tuple[int, int]) -> Fp8Tensor:
    if x.dim() != 2:
        raise ValueError(f"blockwise quantization takes a 2-D tensor, got shape {tuple(x.shape)}")
    amax = nan_amax(block_grid(x, block), dims=(1, 3))
    scale = current_scale(amax, fmt.max, pow2=True)
    q, sat, under = scaled_cast(x, expand_blocks(scale, block, x.shape), fmt)
    return Fp8Tensor(q, reciprocal(scale), fmt, block, sat, under)
