"""npuspeed's CPU flash attention kernels, and the API other features build on.

Two kernels, one contract: bf16 on AVX512-BF16 CPUs (`npuspeed::flash_attention`,
csrc/x86/, about 2x PyTorch's bf16 kernel) and fp32 anywhere (`npuspeed::flash_attention_fp32`,
csrc/cpu/, portable `at::vec`). Both take Megatron's [s, b, h, d] layout, any GQA grouping,
attention dropout drawn in the kernel from a counter-based generator (the keep decision of
element (batch, global head, global query, global key) is a pure function of seed and offset,
so backward regenerates it), and per-row key ranges instead of masks.

API (also what context parallelism uses; see attention_bounds.py for the ranges):

- `FlashParams(scale, causal, dropout_p, seed, offset, q_pos0, k_pos0, head0)`: q_pos0 /
  k_pos0 are the global positions of query row 0 / key row 0 (causal compares global
  positions; dropout draws at global positions), head0 the global index of local head 0.
- `forward(q, k, v, params, key_lo=None, key_hi=None) -> (out [sq, b, hq, d], lse [b, hq, sq])`:
  lse is the natural-log log-sum-exp of the un-dropped softmax (fp32; -inf for a row that
  sees no key, whose output is 0), as ring attention merges need.
- `backward(grad_out, q, k, v, out, lse, params, key_lo, key_hi) -> (dq, dk, dv)`: out and lse
  may be the final merged ones of a ring (FlashAttention-2's backward only needs those).
- `flash_attention(q, k, v, params, key_lo, key_hi) -> context [sq, b, hq * d]`, with autograd.
- `dropout_mask(b, h, sq, sk, params) -> bool [b, h, sq, sk]` (True = kept): the mask the
  kernels draw, for tests only.
key_lo / key_hi: int32 [b, sq] (strides free: expand a [b, 1] one), the global key positions
[lo, hi) each query row may see, on top of causal.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from npuspeed.ops import _dispatch
from npuspeed.ops._extension import has_op
from npuspeed.ops.build_flags import cpu_flags, x86_kernels_excluded

OP = "flash_attention"  # the bf16 kernel (x86)
OP_FP32 = "flash_attention_fp32"  # the portable fp32 kernel


@dataclass(frozen=True)
class FlashParams:
    """Everything of one attention call besides the tensors."""

    scale: float
    causal: bool = False
    dropout_p: float = 0.0
    seed: int = 0
    offset: int = 0
    q_pos0: int = 0
    k_pos0: int = 0
    head0: int = 0

    def op_args(self) -> tuple:
        return (float(self.scale), bool(self.causal), float(self.dropout_p), int(self.seed), int(self.offset),
                int(self.q_pos0), int(self.k_pos0), int(self.head0))


@functools.lru_cache(maxsize=None)
def machine_reason() -> str | None:
    """Why this process cannot run the bf16 kernel at all, or None when it can."""
    if not has_op(OP_FP32):  # the portable set is always built with the library
        return "the npuspeed C++ op library is not loaded (see `npuspeed report`)"
    if not has_op(OP):
        return x86_kernels_excluded() or "the library was built without the x86 kernels"
    if "avx512_bf16" not in cpu_flags():
        return "this CPU lacks AVX512-BF16"
    return None


@functools.lru_cache(maxsize=None)
def fp32_reason() -> str | None:
    """Why this process cannot run the fp32 kernel, or None when it can."""
    if not has_op(OP_FP32):
        return "the npuspeed C++ op library is not loaded (see `npuspeed report`)"
    return None


def unsupported(query: torch.Tensor, key: torch.Tensor, *, masked: bool, dropout_p: float = 0.0,
                causal: bool = False) -> str | None:
    """Why this call cannot run a kernel here ([s, b, h, d] tensors), or None when it can.

    `masked`: the call has a mask that is not per-row key ranges (those the kernels take)."""
    if not _dispatch.on_host(query, key):
        return "the kernels run CPU tensors"
    if query.dtype != key.dtype or query.dtype not in (torch.bfloat16, torch.float32):
        return "the kernels run bf16 or fp32 tensors"
    reason = machine_reason() if query.dtype == torch.bfloat16 else fp32_reason()
    if reason:
        return reason
    if masked:
        return "a mask that is not per-row key ranges (an arbitrary pattern, or one that varies by head)"
    if not 0.0 <= dropout_p < 1.0:
        return f"dropout p={dropout_p} (the kernels take [0, 1))"
    if query.dtype == torch.bfloat16 and query.shape[-1] % 16:
        return f"head dim {query.shape[-1]} is not a multiple of 16 (the bf16 kernel's tiles)"
    return None


def _ops(dtype: torch.dtype):
    ops = torch.ops.npuspeed
    if dtype == torch.bfloat16:
        return ops.flash_attention, ops.flash_attention_backward
    return ops.flash_attention_fp32, ops.flash_attention_fp32_backward


def _register() -> None:
    def fake_fwd(query, key, value, scale, causal, dropout_p=0.0, seed=0, offset=0, q_pos0=0, k_pos0=0,
                 head0=0, key_lo=None, key_hi=None):
        sq, b, hq, _ = query.shape
        return query.new_empty(query.shape), query.new_empty((b, hq, sq), dtype=torch.float32)

    def fake_bwd(grad, query, key, value, out, lse, *args):
        return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)

    for name in (OP, OP_FP32):
        if has_op(name):
            torch.library.register_fake(f"npuspeed::{name}")(fake_fwd)
            torch.library.register_fake(f"npuspeed::{name}_backward")(fake_bwd)


def forward(q, k, v, params: FlashParams, key_lo=None, key_hi=None):
    """(out [sq, b, hq, d], lse [b, hq, sq] fp32); no autograd (see the module docstring)."""
    _dispatch.ensure_registered(OP, _register)
    fwd, _ = _ops(q.dtype)
    _dispatch.record(OP if q.dtype == torch.bfloat16 else OP_FP32, "cpp")
    return fwd(q, k, v, *params.op_args(), key_lo, key_hi)


def backward(grad_out, q, k, v, out, lse, params: FlashParams, key_lo=None, key_hi=None):
    """(dq, dk, dv) of `forward` (see the module docstring)."""
    _dispatch.ensure_registered(OP, _register)
    _, bwd = _ops(q.dtype)
    return bwd(grad_out, q, k, v, out, lse, *params.op_args(), key_lo, key_hi)


class _Flash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_lo, key_hi, params):
        out, lse = forward(q, k, v, params, key_lo, key_hi)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bounds, ctx.params = (key_lo, key_hi), params
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(grad_out, q, k, v, out, lse, ctx.params, *ctx.bounds)
        return dq, dk, dv, None, None, None


def flash_attention_with_lse(q, k, v, params: FlashParams, key_lo=None, key_hi=None):
    """(out [sq, b, hq, d], lse) with autograd through out."""
    reason = unsupported(q, k, masked=False, dropout_p=params.dropout_p)
    if reason:
        raise ValueError(f"npuspeed flash_attention cannot run this call: {reason}")
    return _Flash.apply(q, k, v, key_lo, key_hi, params)


def flash_attention(q, k, v, params: FlashParams | None = None, key_lo=None, key_hi=None, *,
                    scale: float | None = None, causal: bool = False) -> torch.Tensor:
    """query [sq, b, hq, d], key/value [sk, b, hk, d] (CPU, bf16 or fp32) -> context [sq, b, hq * d]."""
    if params is None:
        params = FlashParams(scale=q.shape[-1] ** -0.5 if scale is None else scale, causal=causal)
    out, _lse = flash_attention_with_lse(q, k, v, params, key_lo, key_hi)
    sq, b, hq, d = out.shape
    return out.view(sq, b, hq * d)


def dropout_mask(batch: int, heads: int, sq: int, sk: int, params: FlashParams) -> torch.Tensor:
    """bool [batch, heads, sq, sk], True = kept: what the kernels draw for `params` (tests only)."""
    return torch.ops.npuspeed.attention_dropout_mask(batch, heads, sq, sk, float(params.dropout_p),
                                                     int(params.seed), int(params.offset), int(params.q_pos0),
                                                     int(params.k_pos0), int(params.head0))
