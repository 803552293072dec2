"""The two FP8 element formats and the saturating cast every recipe ends with.

E4M3 (torch.float8_e4m3fn: no infinities, max 448) and E5M2 (torch.float8_e5m2: IEEE-like,
max 57344). Megatron's `--fp8-format e4m3` uses E4M3 everywhere; `hybrid` uses E4M3 for
activations and weights (forward) and E5M2 for output gradients (backward), as TE defines it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    name: str
    dtype: torch.dtype
    max: float          # largest finite value
    emax: int           # exponent of `max` (OCP MX's emax_elem): 448 = 1.75 * 2**8
    min_subnormal: float
    overflow_from: float  # round-to-nearest-even of |y| >= this (> for E4M3) would pass max: the clamp acts
    overflow_tie_up: bool  # whether the tie at overflow_from itself rounds up (max's mantissa is odd)

    def saturates(self, y):
        """Elements the saturating clamp changes: RNE alone would give more than max (or Inf)."""
        a = y.abs()
        return (a >= self.overflow_from) if self.overflow_tie_up else (a > self.overflow_from)

    @property
    def unit_roundoff(self) -> float:
        """Half an ulp relative to a normal value: 2**-(mantissa bits + 1)."""
        return torch.finfo(self.dtype).eps / 2

# 448 = 1.110b * 2**8: the tie with 480 at 464 rounds down to the even 448;
# 57344 = 1.11b * 2**15: the tie with 65536 at 61440 rounds up, away from the odd 57344
E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 8, 2.0 ** -9, 464.0, False)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 15, 2.0 ** -16, 61440.0, True)

FORMAT_NAMES = ("e4m3", "hybrid")


def formats_for(fp8_format: str) -> tuple[Fp8Format, Fp8Format]:
    """(forward format, gradient format) for Megatron's `--fp8-format` value."""
    if fp8_format == "e4m3":
        return E4M3, E4M3
    if fp8_format == "hybrid":
        return E4M3, E5M2
    raise ValueError(f"--fp8-format {fp8_format!r}: expected one of {FORMAT_NAMES}")


def cast_saturating(y: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """fp32 -> FP8, round to nearest even; finite overflow and +-Inf saturate to +-max, NaN stays NaN.

    The clamp is explicit: torch's eager cast saturates E4M3 but sends E5M2 overflow to Inf,
    and TE's casts saturate both.
    """
    return y.clamp(-fmt.max, fmt.max).to(fmt.dtype)
