"""Per-tensor scaling: current (Megatron's `--fp8-recipe tensorwise`, TE's Float8CurrentScaling)
and with a given scale (what delayed scaling quantizes with).

`amax_reduce`, when given, turns the local amax into the group's (TE reduces it with MAX over
the tensor-parallel group so that every TP rank quantizes alike).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from npuspeed.ops.fp8.cast import scaled_cast
from npuspeed.ops.fp8.formats import Fp8Format
from npuspeed.ops.fp8.quantized import Fp8Tensor
from npuspeed.ops.fp8.scaling import current_scale, nan_amax, reciprocal

AmaxReduce = Optional[Callable[[torch.Tensor], torch.Tensor]]


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> Fp8Tensor:
    scale = scale.float().reshape(())
    q, sat, under = scaled_cast(x, scale, fmt)
    return Fp8Tensor(q, reciprocal(scale), fmt, None, sat, under)


def quantize_tensorwise(x: torch.Tensor, fmt: Fp8Format, amax_reduce: AmaxReduce = None) -> Fp8Tensor:
    amax = nan_amax(x)
    if amax_reduce is not None:
        amax = amax_reduce(amax)
    return quantize_with_scale(x, current_scale(amax, fmt.max), fmt)
