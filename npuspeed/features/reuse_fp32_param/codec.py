"""Exact split of an fp32 tensor into its bf16 rounding plus a 16-bit residual, and back.

For a non-NaN fp32 bit pattern x, round-to-nearest-even gives bf16(x) = (x + 0x7FFF +
((x >> 16) & 1)) >> 16, the pattern `tensor.to(torch.bfloat16)` produces. Keep the low
16 bits L of x as the residual. Then the high half of x is bf16(x) - carry, where carry
is 1 when L > 0x8000 and 0 when L < 0x8000. When L == 0x8000 (an exact tie) both carries
leave an even bf16, so one more bit is needed: the ties that rounded up are recorded as a
sparse list of indices. Ties are 1 in 65536 of random values, so this costs almost nothing
(a dense bit mask would cost 1/8 byte per parameter, 6% of the 2 bytes saved). NaNs lose
their payload in the bf16 rounding; their full patterns are kept the same sparse way.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from npuspeed import telemetry
from npuspeed.ops._extension import has_op

#: counter prefix: reuse.codec.<split|merge>.<cpp|reference>, so tests can see the C++ path ran
COUNTER = "reuse.codec."

_LOW = 0xFFFF
_TIE = 0x8000


@dataclass
class Exceptions:
    """What the residual alone cannot restore: tie indices that rounded up, NaN patterns."""

    tie_up: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    nan_index: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    nan_bits: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int32))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tie_up, self.nan_index, self.nan_bits))


def _use_cpp(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and has_op("fp32_split")


def split(master: torch.Tensor, residual: torch.Tensor) -> Exceptions:
    """Write the low halves of `master` into `residual`; return the exceptions (C++ or reference)."""
    if _use_cpp(master, residual):
        telemetry.count(COUNTER + "split.cpp")
        flat = master.detach().reshape(-1)
        tie_up, nan_index = torch.ops.npuspeed.fp32_split(flat, residual.view(-1))
        return Exceptions(tie_up, nan_index, flat.view(torch.int32)[nan_index].clone())
    telemetry.count(COUNTER + "split.reference")
    return split_reference(master, residual)


def merge(bf16: torch.Tensor, residual: torch.Tensor, exceptions: Exceptions, out: torch.Tensor) -> None:
    """Rebuild the exact fp32 values into `out` (C++ or reference)."""
    if _use_cpp(bf16, residual, out):
        telemetry.count(COUNTER + "merge.cpp")
        torch.ops.npuspeed.fp32_merge(bf16.detach().reshape(-1), residual.view(-1), exceptions.tie_up,
                                      exceptions.nan_index, exceptions.nan_bits, out.view(-1))
        return
    telemetry.count(COUNTER + "merge.reference")
    merge_reference(bf16, residual, exceptions, out)


def split_reference(master: torch.Tensor, residual: torch.Tensor) -> Exceptions:
    """Write the low halves of `master` (fp32) into `residual` (int16); return the exceptions.

    The bf16 half is not written here: it is `master.to(torch.bfloat16)`, which Megatron's
    copy of main params into model params already produced.
    """
    bits = master.detach().reshape(-1).view(torch.int32)
    low = bits & _LOW
    residual.view(-1).copy_(low.to(torch.int16))
    tie_up = torch.nonzero(((low == _TIE) & ((bits >> 16) & 1).bool()), as_tuple=False).reshape(-1)
    nan_index = torch.nonzero(torch.isnan(master.detach().reshape(-1)), as_tuple=False).reshape(-1)
    return Exceptions(tie_up, nan_index, bits[nan_index].clone())


def merge_reference(bf16: torch.Tensor, residual: torch.Tensor, exceptions: Exceptions,
                    out: torch.Tensor) -> None:
    """Rebuild the exact fp32 values into `out` from the bf16 tensor, residual and exceptions."""
    high = bf16.detach().reshape(-1).view(torch.int16).to(torch.int32) & _LOW
    low = residual.reshape(-1).to(torch.int32) & _LOW
    carry = (low > _TIE).to(torch.int32)
    if exceptions.tie_up.numel():
        carry[exceptions.tie_up] = 1
    words = ((high - carry) << 16) | low
    if exceptions.nan_index.numel():
        words[exceptions.nan_index] = exceptions.nan_bits
    out.view(-1).view(torch.int32).copy_(words)
