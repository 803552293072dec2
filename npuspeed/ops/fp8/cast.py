"""Apply scales and cast: the step every recipe shares, with its saturation and underflow counts.

`scaled_cast(x, scale)`: y = x * scale in fp32, then `cast_saturating`. Counted per call:
`saturated` (the elements the clamp changed: Inf, and finite values that round-to-nearest-even
would have taken past max; 448.01 rounds to 448 either way and is not counted) and
`underflowed` (nonzero finite x that became 0). NaN is neither.
"""
from __future__ import annotations

import torch

from npuspeed.ops.fp8.formats import Fp8Format, cast_saturating


def scaled_cast(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format):
    xf = x.float()
    y = xf * scale
    q = cast_saturating(y, fmt)
    saturated = fmt.saturates(y).sum()
    underflowed = ((xf != 0) & torch.isfinite(xf) & (q.float() == 0)).sum()
    return q, saturated, underflowed


def pad_to_blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Zero-pad a 2-D tensor to whole blocks (padding never changes a block's amax)."""
    rows, cols = x.shape
    pr, pc = -rows % block[0], -cols % block[1]
    return torch.nn.functional.pad(x, (0, pc, 0, pr)) if pr or pc else x


def block_grid(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[R, C] -> [R/br, br, C/bc, bc] over the padded tensor."""
    xp = pad_to_blocks(x, block)
    br, bc = block
    return xp.reshape(xp.shape[0] // br, br, xp.shape[1] // bc, bc)


def expand_blocks(grid: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    """One value per block -> one per element of a tensor of `shape`."""
    return grid.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]
