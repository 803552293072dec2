"""EMULATOR (not the real op) of torch_npu's npu_rms_norm, npu_swiglu, npu_rotary_mul and their
backward ops, following the documentation in torch_npu's wheels (`_op_plugin_docs.py`, the same
text in 2.6.0, 2.9.0 and 2.14.0 but for npu_rotary_mul's `rotate`, new in 2.14.0) and the
output shapes/dtypes of the wheels' meta functions (`op_plugin/meta/_meta_registrations.py`).

npu_rms_norm: self fp16/bf16/fp32 with 2-8 dims, gamma of self's dtype over self's trailing
dims (the text says gamma has 2-8 dims, its own example passes a 1-D gamma: trailing dims it is);
rstd is fp32, shaped as self with gamma's dims set to 1. npu_swiglu: self 1-8 dims, fp32/fp16/
bf16, split into halves A, B along `dim`. Computation in fp32, rounded once to the input dtype.
The rotary ops are in emulate_rope.py (their limits are many) and exported from here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .emulate_limits import FLOATS, dtype_in, limit
from .emulate_rope import EMULATORS as _ROPE


def _check_rms(op, x, gamma):
    dtype_in(op, "self", x, FLOATS)
    limit(op, 2 <= x.dim() <= 8, f"self must have 2-8 dims, got {x.dim()}")
    limit(op, gamma.dtype == x.dtype, f"gamma's dtype must equal self's ({x.dtype}), got {gamma.dtype}")
    g = gamma.dim()
    limit(op, 1 <= g <= x.dim() and tuple(gamma.shape) == tuple(x.shape[x.dim() - g:]),
          f"gamma {tuple(gamma.shape)} must be self's trailing dims {tuple(x.shape)}")
    return tuple(range(x.dim() - g, x.dim()))


def npu_rms_norm(self, gamma, epsilon=1e-6):
    dims = _check_rms("npu_rms_norm", self, gamma)
    xf = self.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(self.dtype), rstd


def _rms_norm_backward(dy, self, gamma, rstd, dgamma_dtype):
    op = "npu_rms_norm_backward"
    dims = _check_rms(op, self, gamma)
    limit(op, dy.shape == self.shape, f"dy {tuple(dy.shape)} must have self's shape {tuple(self.shape)}")
    want = tuple(1 if i in dims else s for i, s in enumerate(self.shape))
    limit(op, tuple(rstd.shape) == want and rstd.dtype == torch.float32,
          f"rstd must be npu_rms_norm's fp32 {want}, got {rstd.dtype} {tuple(rstd.shape)}")
    xf, dyg = self.float(), dy.float() * gamma.float()
    mean = (dyg * xf).mean(dims, keepdim=True)
    dx = rstd * dyg - xf * rstd.pow(3) * mean
    lead = tuple(range(self.dim() - gamma.dim()))
    dgamma = (dy.float() * xf * rstd).sum(lead) if lead else dy.float() * xf * rstd
    return dx.to(self.dtype), dgamma.reshape(gamma.shape).to(dgamma_dtype or gamma.dtype)


def _halves(op, x, dim):
    dtype_in(op, "self", x, FLOATS)
    limit(op, 1 <= x.dim() <= 8, f"self must have 1-8 dims, got {x.dim()}")
    limit(op, -x.dim() <= dim < x.dim(), f"dim {dim} out of range for {x.dim()} dims")
    limit(op, x.shape[dim] % 2 == 0, f"self's size along dim {dim} must split into halves A, B, got {x.shape[dim]}")
    a, b = torch.chunk(x.float(), 2, dim=dim)
    return a, b


def npu_swiglu(self, dim=-1):
    a, b = _halves("npu_swiglu", self, dim)
    return (F.silu(a) * b).to(self.dtype)


def npu_swiglu_backward(grad_output, self, dim=-1):
    op = "npu_swiglu_backward"
    a, b = _halves(op, self, dim)
    limit(op, grad_output.shape == a.shape, f"grad_output {tuple(grad_output.shape)} must be the output's {tuple(a.shape)}")
    g, sig = grad_output.float(), torch.sigmoid(a)
    da = g * b * sig * (1 + a * (1 - sig))
    return torch.cat((da, g * a * sig), dim=dim).to(self.dtype)


def npu_rms_norm_backward(dy, self, gamma, rstd):
    """dgamma in fp32 (2.14.0's meta function)."""
    return _rms_norm_backward(dy, self, gamma, rstd, torch.float32)


def _rms_norm_backward_gamma_dtype(dy, self, gamma, rstd):
    """dgamma in gamma's dtype (2.6.0's and 2.9.0's meta function)."""
    return _rms_norm_backward(dy, self, gamma, rstd, None)


EMULATORS = {"npu_rms_norm": npu_rms_norm, "npu_rms_norm_backward": npu_rms_norm_backward,
             "npu_swiglu": npu_swiglu, "npu_swiglu_backward": npu_swiglu_backward, **_ROPE}


def emulators(release: str) -> dict:
    """EMULATORS as torch_npu `release`'s meta functions shape them: npu_rms_norm_backward's
    dgamma is fp32 in 2.14.0, gamma's dtype in 2.6.0 and 2.9.0 (releases in between: unread,
    taken as 2.14.0)."""
    found = dict(EMULATORS)
    if tuple(int(p) for p in release.split(".")[:2]) <= (2, 9):
        found["npu_rms_norm_backward"] = _rms_norm_backward_gamma_dtype
    return found
