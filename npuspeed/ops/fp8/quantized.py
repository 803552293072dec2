"""`Fp8Tensor`: FP8 data with the scales that decode it, and the statistics of its quantization.

One class for every recipe: a per-tensor recipe has one fp32 `scale_inv` (0-dim); a block
recipe has one per block of `block = (rows, cols)` elements (1x128, 128x128, 1x32), stored as a
[ceil(R/rows), ceil(C/cols)] grid. The decoded value is `data * scale_inv` of its block, exactly
as TE's `scale_inv` and the OCP MX spec's shared scale X are applied.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from npuspeed.ops.fp8.formats import Fp8Format


@dataclass
class Fp8Tensor:
    data: torch.Tensor                 # FP8, 2-D [R, C]
    scale_inv: torch.Tensor            # fp32: 0-dim, or [ceil(R/block[0]), ceil(C/block[1])]
    fmt: Fp8Format
    block: Optional[tuple[int, int]] = None   # None: one scale for the whole tensor
    saturated: Optional[torch.Tensor] = None  # elements clamped to +-max (int64, 0-dim)
    underflowed: Optional[torch.Tensor] = None  # nonzero elements that became zero
    scale_e8m0: Optional[torch.Tensor] = None   # MXFP8: the biased E8M0 scales (float8_e8m0fnu)

    def expanded_scale_inv(self) -> torch.Tensor:
        """`scale_inv` broadcast to one value per element of `data`."""
        if self.block is None:
            return self.scale_inv
        rows, cols = self.data.shape
        br, bc = self.block
        return self.scale_inv.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]

    def dequantize(self) -> torch.Tensor:
        """fp32 values; exact whenever the scales are powers of two (blockwise, MXFP8)."""
        return self.data.float() * self.expanded_scale_inv()

    def t(self) -> "Fp8Tensor":
        """The transpose, for the GEMMs that contract the other dimension.

        Valid for a per-tensor scale and square blocks (TE's 128x128 weights); a 1-D block
        along one dimension must be quantized again along the other instead.
        """
        if self.block is not None and self.block[0] != self.block[1]:
            raise ValueError(f"a {self.block[0]}x{self.block[1]} block quantization cannot be "
                             "transposed; quantize the transposed tensor instead")
        scale_inv = self.scale_inv if self.block is None else self.scale_inv.t()
        e8m0 = None if self.scale_e8m0 is None else self.scale_e8m0.t()
        return replace(self, data=self.data.t(), scale_inv=scale_inv, scale_e8m0=e8m0)
