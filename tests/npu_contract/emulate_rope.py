"""EMULATOR (not the real op) of torch_npu's npu_rotary_mul / npu_rotary_mul_backward, following
`_op_plugin_docs.py` of torch_npu 2.6.0/2.9.0/2.14.0 (same text; 2.14.0 adds `rotate`), its
jit_compile=False constraints (the default on Atlas A2/A3, what npuspeed trains on):

- self, r1, r2: 4-D, fp16/bf16/fp32; D (last dim) even and < 896; r2 shaped as r1.
- self's layout is BNSD, BSND or SBND; r1/r2 broadcast as the layout allows: half mode 11SD,
  B1SD, BNSD / 1S1D, BS1D, BSND / S11D, SB1D, SBND; interleave mode only 11SD / 1S1D / S11D.
  A 4-D shape does not name its layout: a call is accepted when some layout fits both the
  r1 pattern and the size limits (half: B < 1000 and N < 1000; interleave: B * N < 1000).
- r1, r2 values in [-1, 1].
- backward: when cos/sin need a gradient (r1 or r2 requires grad), B * N <= 1024.
- rotate (2.14.0): 2-D [D, D], x_new = self @ rotate; it "does not support backpropagation" (the
  backward op has no rotate: a stand-in's autograd must refuse it, this forward cannot tell).
out = r1 * x + r2 * rotate_half(x), in fp32, rounded to self's dtype; dr1/dr2 are reduced to
r1/r2's shapes and carry self's dtype (the meta function's).
"""
from __future__ import annotations

import torch

from .emulate_limits import FLOATS, dtype_in, has_values, limit

#: layout -> the axis of B, N, S among the first three
LAYOUTS = {"BNSD": "BNS", "BSND": "BSN", "SBND": "SBN"}
PATTERNS = {"half": ("S", "BS", "BNS"), "interleave": ("S",)}


def _fits(x_shape, r_shape, letters, kept) -> bool:
    return all(r_shape[i] == (x_shape[i] if letters[i] in kept else 1) for i in range(3))


def _layouts(op, x, r1, r2, mode):
    """The (layout, B, N) under which this call is within the documented limits."""
    for name, t in (("self", x), ("r1", r1), ("r2", r2)):
        dtype_in(op, name, t, FLOATS)
        limit(op, t.dim() == 4, f"{name} must be 4-D, got {t.dim()}-D")
    limit(op, mode in PATTERNS, f"rotary_mode must be 'half' or 'interleave', got {mode!r}")
    d = x.shape[-1]
    limit(op, d % 2 == 0 and d < 896, f"D={d} must be even and < 896")
    limit(op, r1.shape == r2.shape, f"r2 {tuple(r2.shape)} must be shaped as r1 {tuple(r1.shape)}")
    limit(op, r1.shape[-1] == d, f"r1's last dim must be D={d}, got {r1.shape[-1]}")
    found = []
    for layout, letters in LAYOUTS.items():
        if any(_fits(x.shape, r1.shape, letters, kept) for kept in PATTERNS[mode]):
            b, n = x.shape[letters.index("B")], x.shape[letters.index("N")]
            if (b < 1000 and n < 1000) if mode == "half" else b * n < 1000:
                found.append((layout, b, n))
    limit(op, found, f"r1 {tuple(r1.shape)} fits no layout allowed for self {tuple(x.shape)} in {mode} mode "
          f"(BNSD/BSND/SBND with r1 as {'/'.join(PATTERNS[mode])} of it, "
          f"{'B, N < 1000' if mode == 'half' else 'B * N < 1000'})")
    for name, t in (("r1", r1), ("r2", r2)):
        if has_values(t) and t.numel():
            top = t.abs().max().item()
            limit(op, top <= 1, f"{name} values must lie in [-1, 1], max |{name}| = {top:.4g}")
    return found


def _rotate(x, mode, rotate=None):
    if rotate is not None:
        return x @ rotate.float()
    if mode == "half":
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def npu_rotary_mul(self, r1, r2, rotary_mode="half", rotate=None):
    op = "npu_rotary_mul"
    _layouts(op, self, r1, r2, rotary_mode)
    if rotate is not None:
        dtype_in(op, "rotate", rotate, FLOATS)
        d = self.shape[-1]
        limit(op, rotate.dim() == 2 and tuple(rotate.shape) == (d, d),
              f"rotate must be 2-D [{d}, {d}], got {tuple(rotate.shape)}")
    x = self.float()
    return (r1.float() * x + r2.float() * _rotate(x, rotary_mode, rotate)).to(self.dtype)


def _reduce_to(t, shape):
    dims = tuple(i for i, s in enumerate(shape) if s == 1 and t.shape[i] != 1)
    return t.sum(dims, keepdim=True) if dims else t


def npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode="half"):
    op = "npu_rotary_mul_backward"
    found = _layouts(op, self, r1, r2, rotary_mode)
    limit(op, grad.shape == self.shape, f"grad {tuple(grad.shape)} must have self's shape {tuple(self.shape)}")
    if r1.requires_grad or r2.requires_grad:
        limit(op, any(b * n <= 1024 for _, b, n in found), "B * N must be <= 1024 when cos/sin need a gradient")
    g, x = grad.float(), self.float()
    dx = r1.float() * g - _rotate(r2.float() * g, rotary_mode)  # rotate_half's transpose is -rotate_half
    dr1 = _reduce_to(g * x, r1.shape)
    dr2 = _reduce_to(g * _rotate(x, rotary_mode), r2.shape)
    return dx.to(self.dtype), dr1.to(self.dtype), dr2.to(self.dtype)


EMULATORS = {"npu_rotary_mul": npu_rotary_mul, "npu_rotary_mul_backward": npu_rotary_mul_backward}
