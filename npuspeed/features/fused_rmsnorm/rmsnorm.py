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

import torch.nn.functional as F

from npuspeed import telemetry
from npuspeed.ops import _dispatch
from npuspeed.ops.rms_norm import fused_rms_norm

TARGET = "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__"
#: counter: how many norms were made fused in this process (the report shows it)
SWAPPED = "rmsnorm.swapped"
#: what the flag needs, for the error when a built block has no such norm
NEEDS = ("needs RMSNorm built by Megatron's local spec (--normalization RMSNorm, "
         "--transformer-impl local)")


class FusedRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm computed by the fastest of npuspeed's fused op, the device's native op
    and torch.nn.RMSNorm's own forward (measured once per shape; same parameters, state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1 or self.weight is None:
            _dispatch.record("rms_norm", "megatron")
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        shape, module_eps = self.normalized_shape, self.eps
        return fused_rms_norm(x, self.weight, eps, lambda x, w: F.rms_norm(x, shape, w, module_eps))


def fused_norm(new):
    @functools.wraps(new)
    def __new__(cls, config, *args, **kwargs):
        norm = new(cls, config, *args, **kwargs)
        if type(norm) is torch.nn.RMSNorm:
            norm.__class__ = FusedRMSNorm
            telemetry.count(SWAPPED)
        return norm

    return __new__


def acts_in(block) -> bool:
    return any(isinstance(m, FusedRMSNorm) for m in block.modules())


def found_in(block) -> str:
    norms = sorted({type(m).__name__ for m in block.modules() if "norm" in type(m).__name__.lower()})
    return f"normalization={getattr(block.config, 'normalization', '?')}, norm modules: {', '.join(norms) or 'none'}"

