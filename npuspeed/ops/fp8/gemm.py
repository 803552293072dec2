"""`fp8_mm(a, b)`: a @ b.T for two `Fp8Tensor`s quantized along their last (contraction) dimension.

Two backends. `scaled_mm`: torch._scaled_mm with the per-tensor scales (CUDA from sm_89; torch
2.13's CPU build runs E4M3/E5M2 operands with tensorwise scales, fp32 or bf16 out). `emulate`:
what an FP8 tensor core computes, in fp32: products of FP8 values are exact in fp32, so the
per-tensor case multiplies the raw FP8 values in fp32 and applies scale_a * scale_b to the fp32
sums, and the block recipes decode each operand with its power-of-two block scales (exact) and
multiply in fp32 -- every partial sum promoted to fp32, as DeepSeek-V3 does per 128-block.
"""
from __future__ import annotations

import torch

from npuspeed.ops.fp8.quantized import Fp8Tensor


def fp8_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype, backend: str = "emulate") -> torch.Tensor:
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"fp8_mm: contraction dims differ: {tuple(a.data.shape)} x {tuple(b.data.shape)}.T")
    per_tensor = a.block is None and b.block is None
    if backend == "scaled_mm":
        if not per_tensor:
            raise ValueError("fp8_mm: the scaled_mm backend takes per-tensor scales only")
        return torch._scaled_mm(a.data.contiguous(), b.data.contiguous().t(),
                                scale_a=a.scale_inv.reshape(()), scale_b=b.scale_inv.reshape(()),
                                out_dtype=out_dtype)
    if per_tensor:
        acc = a.data.float() @ b.data.float().t()
        return (acc * (a.scale_inv * b.scale_inv)).to(out_dtype)
    return (a.dequantize() @ b.dequantize().t()).to(out_dtype)
