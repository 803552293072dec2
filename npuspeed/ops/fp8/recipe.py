"""`Fp8Recipe`: Megatron's FP8 options as one value, and which quantizer each GEMM operand gets.

Roles follow TE: `input` (activations) and `weight` in the forward format, `grad_output` in the
gradient format (E5M2 under `hybrid`). Every operand is quantized along the GEMM's contraction
dimension (its last dimension here): per-tensor recipes quantize a tensor once and transpose
it; 1x128 and 1x32 blocks need the transposed tensor quantized again (TE's "columnwise" copy);
128x128 weight blocks transpose.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from npuspeed.ops.fp8.blockwise import ACTIVATION_BLOCK, WEIGHT_BLOCK, quantize_blockwise
from npuspeed.ops.fp8.delayed import AMAX_COMPUTE_ALGOS, DelayedScaling
from npuspeed.ops.fp8.formats import Fp8Format, formats_for
from npuspeed.ops.fp8.mxfp8 import quantize_mxfp8
from npuspeed.ops.fp8.quantized import Fp8Tensor
from npuspeed.ops.fp8.tensorwise import AmaxReduce, quantize_tensorwise

RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
PER_TENSOR = ("tensorwise", "delayed")
ROLES = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class Fp8Recipe:
    recipe: str = "tensorwise"
    fp8_format: str = "hybrid"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad_fp8: bool = True            # Megatron's fp8_wgrad: False runs the weight gradient in high precision
    backend: str = "emulate"          # "scaled_mm": torch._scaled_mm for the per-tensor recipes
    amax_reduce: AmaxReduce = field(default=None, compare=False)

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise ValueError(f"--fp8-recipe {self.recipe!r}: npuspeed runs {', '.join(RECIPES)}")
        formats_for(self.fp8_format)
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"--fp8-amax-compute-algo {self.amax_compute_algo!r}: "
                             f"expected one of {AMAX_COMPUTE_ALGOS}")
        if self.amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len {self.amax_history_len}: must be at least 1")
        if self.backend not in ("emulate", "scaled_mm"):
            raise ValueError(f"FP8 GEMM backend {self.backend!r}: expected emulate or scaled_mm")
        if self.backend == "scaled_mm" and self.recipe not in PER_TENSOR:
            raise ValueError(f"--fp8-recipe {self.recipe}: torch._scaled_mm with its block scales is "
                             "not wired in npuspeed yet; its GEMMs run the exact emulation")

    @property
    def per_tensor(self) -> bool:
        return self.recipe in PER_TENSOR

    def format_of(self, role: str) -> Fp8Format:
        fwd, bwd = formats_for(self.fp8_format)
        return bwd if role == "grad_output" else fwd

    def new_state(self) -> dict[str, DelayedScaling] | None:
        """Per-linear state: the delayed recipe's three scalers, else None."""
        if self.recipe != "delayed":
            return None
        return {role: DelayedScaling(self.format_of(role), margin=self.margin,
                                     history_len=self.amax_history_len, algo=self.amax_compute_algo)
                for role in ROLES}

    def quantize(self, x: torch.Tensor, role: str, state=None) -> Fp8Tensor:
        """`x` (2-D) quantized for a GEMM contracting its last dimension."""
        fmt = self.format_of(role)
        if self.recipe == "tensorwise":
            return quantize_tensorwise(x, fmt, self.amax_reduce)
        if self.recipe == "delayed":
            return state[role].quantize(x, self.amax_reduce)
        if self.recipe == "blockwise":
            return quantize_blockwise(x, fmt, WEIGHT_BLOCK if role == "weight" else ACTIVATION_BLOCK)
        return quantize_mxfp8(x, fmt)
