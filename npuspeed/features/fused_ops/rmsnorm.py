"""--use-fused-rmsnorm: the RMSNorm that `--normalization RMSNorm` builds runs the fused op.

Megatron's local spec builds norms through `WrappedTorchNorm.__new__`, which returns a
`torch.nn.RMSNorm`. We wrap that constructor (after the device feature's wrapper, which lets
it accept sequence parallelism and marks the parameters `sequence_parallel`) and turn the
module it returns into a `FusedRMSNorm`: a subclass with the same parameters, state dict
and marks, whose forward calls `npuspeed.ops.rms_norm`.
"""
from __future__ import annotations

import functools

import torch

from npuspeed.ops.rms_norm import rms_norm

TARGET = "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__"
#: how many norms were made fused in this process (the report shows it)
SWAPPED = {"count": 0}


class FusedRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm computed by npuspeed's fused op (same parameters and state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, self.weight, eps)


def fused_norm(new):
    @functools.wraps(new)
    def __new__(cls, config, *args, **kwargs):
        norm = new(cls, config, *args, **kwargs)
        if type(norm) is torch.nn.RMSNorm:
            norm.__class__ = FusedRMSNorm
            SWAPPED["count"] += 1
        return norm

    return __new__


def register(registry, feature: str) -> None:
    registry.register(TARGET, wrapper=fused_norm, feature=feature)
