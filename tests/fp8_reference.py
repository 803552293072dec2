"""FP8 quantization written from the definitions, independently of npuspeed.ops.fp8 and of torch's
casts: the formats decoded from their bit layouts, round-to-nearest-even by search over every
representable value, and each recipe's scale computed in numpy fp32/float64 scalars.
Used by tests/unit/test_fp8_quantize.py and test_fp8_linear.py.
"""
from __future__ import annotations

import bisect
import math
from collections import deque

import numpy as np

# (exponent bits, mantissa bits, bias, has_inf) per the OCP FP8 spec / torch's float8_e4m3fn, float8_e5m2
LAYOUT = {"e4m3": (4, 3, 7, False), "e5m2": (5, 2, 15, True)}
FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
EMAX = {"e4m3": 8, "e5m2": 15}
F32_MAX = float(np.finfo(np.float32).max)


def decode(bits: int, name: str) -> float:
    e_bits, m_bits, bias, has_inf = LAYOUT[name]
    sign = -1.0 if bits >> 7 else 1.0
    e = (bits >> m_bits) & ((1 << e_bits) - 1)
    m = bits & ((1 << m_bits) - 1)
    if has_inf and e == (1 << e_bits) - 1:
        return sign * math.inf if m == 0 else math.nan
    if not has_inf and e == (1 << e_bits) - 1 and m == (1 << m_bits) - 1:
        return math.nan                         # E4M3FN: S.1111.111 is the only NaN
    if e == 0:
        return sign * m * 2.0 ** (1 - bias - m_bits)
    return sign * (1 + m / (1 << m_bits)) * 2.0 ** (e - bias)


_GRIDS = {}


def _positive_grid(name):
    if name not in _GRIDS:
        vals = [(decode(b, name), b) for b in range(128)]
        _GRIDS[name] = sorted((v, b) for v, b in vals if math.isfinite(v))
    return _GRIDS[name]


def _grid_keys(name):
    key = name + ".keys"
    if key not in _GRIDS:
        _GRIDS[key] = [g[0] for g in _positive_grid(name)]
    return _GRIDS[key]


def round_to_fp8(y: float, name: str) -> int:
    """Bits of y rounded to nearest even, saturating at +-max, NaN -> canonical NaN bits."""
    if math.isnan(y):
        return 0x7F                              # compared as "is NaN", not by payload
    sign = 0x80 if math.copysign(1.0, y) < 0 else 0
    a = abs(y)
    grid = _positive_grid(name)
    if a >= grid[-1][0]:
        return sign | grid[-1][1]
    i = bisect.bisect_right(_grid_keys(name), a)   # grid[i-1] <= a < grid[i]
    lo, hi = grid[i - 1], grid[i]
    if a - lo[0] < hi[0] - a:
        return sign | lo[1]
    if hi[0] - a < a - lo[0]:
        return sign | hi[1]
    return sign | (lo[1] if lo[1] % 2 == 0 else hi[1])   # tie: even mantissa


def f32(v) -> float:
    return float(np.float32(v))


def amax_ignoring_nan(values) -> float:
    finite_or_inf = [abs(v) for v in values if not math.isnan(v)]
    return max(finite_or_inf) if finite_or_inf else 0.0


def te_current_scale(amax: float, fmax: float, pow2: bool = False) -> float:
    if amax == 0 or not math.isfinite(amax):
        return 1.0
    with np.errstate(over="ignore"):
        s = float(np.float32(fmax) / np.float32(amax))
    if math.isinf(s):
        s = F32_MAX
    if pow2:
        m, e = math.frexp(s)                    # s = m * 2**e, m in [0.5, 1)
        s = 2.0 ** (e - 1)
    return s


def quantize_values(values, scales, name):
    """Bits of each value times its scale (the product rounded to fp32 first, as an fp32 multiply)."""
    out = []
    for v, s in zip(values, scales):
        with np.errstate(over="ignore", invalid="ignore"):
            y = float(np.float32(v) * np.float32(s))
        out.append(round_to_fp8(y, name))
    return out


class DelayedReference:
    """Scale at each step from the window of the last L amaxes (TE DelayedScaling)."""

    def __init__(self, fmax, margin, history_len, algo):
        self.fmax, self.margin, self.algo = fmax, margin, algo
        self.window = deque(maxlen=history_len)
        self.scale = 1.0

    def step(self, values):
        scale = self.scale
        a = f32(amax_ignoring_nan(values))
        self.window.append(a)
        amax = max(self.window) if self.algo == "max" else a
        if amax > 0 and math.isfinite(amax):
            with np.errstate(over="ignore"):
                s = float(np.float32(np.float32(self.fmax) / np.float32(amax)) / np.float32(2.0 ** self.margin))
            self.scale = F32_MAX if math.isinf(s) else s
        return scale


def mx_block_exponent(block_values, name):
    """OCP MX v1.0 6.3: floor(log2(amax)) - emax_elem, E8M0 range; None for an Inf amax (NaN scale)."""
    amax = amax_ignoring_nan(block_values)
    if math.isinf(amax):
        return None
    if amax == 0:
        return -127
    _, e = math.frexp(amax)
    return min(max(e - 1 - EMAX[name], -127), 127)
