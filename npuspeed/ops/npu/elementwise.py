"""torch_npu's fused element-wise kernels npuspeed's ops run on an NPU: RMSNorm, SwiGLU, RoPE."""
from __future__ import annotations

import torch

from npuspeed.ops.npu import library


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """npu_rms_norm's normalised output (its second output, rstd, is dropped)."""
    return library().npu_rms_norm(x, weight, epsilon=float(eps))[0]


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """npu_swiglu over the last dimension ([gate | linear])."""
    return library().npu_swiglu(x, dim=-1)


def rotary_mul(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """npu_rotary_mul (rotate-half mode)."""
    return library().npu_rotary_mul(t, cos, sin)
