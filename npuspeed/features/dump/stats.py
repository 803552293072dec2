"""One tensor's statistics as MindStudio Probe names them (Max, Min, Mean, Norm) plus the NaN and
Inf counts; computed in float64 accumulations over a float32 view, so a bf16 and an fp32 run's
statistics are comparable. Reads the tensor only."""
from __future__ import annotations

import math

import torch


def describe(t) -> dict | None:
    """{type, dtype, shape, Max, Min, Mean, Norm, NaN, Inf} of a tensor (None for a non-tensor)."""
    if not torch.is_tensor(t):
        return None
    out = {"type": "torch.Tensor", "dtype": str(t.dtype), "shape": list(t.shape),
           "requires_grad": bool(t.requires_grad)}
    if t.numel() == 0 or t.is_complex():
        return dict(out, Max=None, Min=None, Mean=None, Norm=0.0, NaN=0, Inf=0)
    with torch.no_grad():
        x = t.detach()
        x = x.float() if x.is_floating_point() else x.double()
        nan = int(torch.isnan(x).sum())
        inf = int(torch.isinf(x).sum())
        if nan or inf:  # the statistics of the finite values; the counts say the rest
            x = x[torch.isfinite(x)]
        if x.numel() == 0:
            return dict(out, Max=None, Min=None, Mean=None, Norm=None, NaN=nan, Inf=inf)
        return dict(out, Max=float(x.max()), Min=float(x.min()), Mean=float(x.sum(dtype=torch.float64)) / x.numel(),
                    Norm=float(torch.linalg.vector_norm(x, dtype=torch.float64)), NaN=nan, Inf=inf)


def numel(stats: dict) -> int:
    return math.prod(stats["shape"])
