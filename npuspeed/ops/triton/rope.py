"""Rotary position embedding in Triton on Megatron's [s, b, h, d] layout, q and k in one launch.

Semantics are `npuspeed.ops.rope.rotary_pos_emb_reference`'s (Megatron's
`_apply_rotary_pos_emb_bshd`): the first rot = freqs.shape[-1] channels are rotated, rotate-half
(or interleaved pairs), the rest pass through; cos and sin are Megatron's (times mscale,
rounded to t's dtype), held in fp32 tables cached per freqs (`npuspeed.ops.rope.cached_cos_sin`).
Each program takes one (s, b) position and a block of heads of q and the same block of k, so
`rotary_pos_emb_qk` is one launch forward and one backward. Channel i's partner is
p(i) = i +- rot/2 (i ^ 1 interleaved): out[i] = t[i] cos[i] -+ t[p(i)] sin[i], and
dt[i] = g[i] cos[i] +- g[p(i)] sin[p(i)]; freqs may vary along s, b or h (strided tables).
What the kernels do not take (freqs needing a gradient, not 4-D, odd rot, fp64) runs the reference.
"""
from __future__ import annotations

import torch

from npuspeed.ops.rope import cached_cos_sin, rotary_pos_emb_reference, supported
from npuspeed.ops.triton import _runtime
from npuspeed.ops.triton._runtime import available  # noqa: F401  (public probe)

tl = None  # triton.language, bound by _runtime.kernels() on first use
TILE = 4096  # heads x head_dim elements per program


def _rope(Q, K, QO, KO, COS, SIN,
          sqs, sqb, sqh, sks, skb, skh, sos, sob, soh, sps, spb, sph,
          cqs, cqb, cqh, cks, ckb, ckh,
          B, HQ, HK, D, ROT,
          BACKWARD: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    pos = tl.program_id(0).to(tl.int64)
    s = pos // B
    b = pos % B
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    rot = d < ROT
    if INTERLEAVED:
        first = (d % 2) == 0
        p = tl.where(first, d + 1, d - 1)
    else:
        half = ROT // 2
        first = d < half
        p = tl.where(first, d + half, d - half)
    # forward: out = t cos + sign t[p] sin, sign -1 on the first of each pair;
    # backward (transpose): dt = g cos - sign g[p] sin[p]
    sign = tl.where(first, -1.0, 1.0)
    if BACKWARD:
        sign = -sign

    for which in tl.static_range(2):  # q's heads, then k's (the same block of heads; none past HK)
        if which == 0:  # (a constexpr: each unrolled turn keeps one branch)
            X, XO, heads = Q, QO, HQ
            x_at = s * sqs + b * sqb + h * sqh  # offsets of the input, the output and the cos/sin tables
            o_at = s * sos + b * sob + h * soh
            t_at = s * cqs + b * cqb + h * cqh
        else:
            X, XO, heads = K, KO, HK
            x_at = s * sks + b * skb + h * skh
            o_at = s * sps + b * spb + h * sph
            t_at = s * cks + b * ckb + h * ckh
        live = (h < heads) & (d < D)
        x = tl.load(X + x_at + d, mask=live, other=0.0).to(tl.float32)
        xp = tl.load(X + x_at + p, mask=live & rot, other=0.0).to(tl.float32)
        c = tl.load(COS + t_at + d, mask=live & rot, other=0.0)
        sn = tl.load(SIN + t_at + p if BACKWARD else SIN + t_at + d, mask=live & rot, other=0.0)
        out = tl.where(rot, x * c + sign * xp * sn, x)
        tl.store(XO + o_at + d, out.to(XO.dtype.element_ty), mask=live)


def _k():
    import sys

    return _runtime.kernels(sys.modules[__name__], ("_rope",))


def _last_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(q, k, cos, sin, interleaved: bool, backward: bool):
    """(q', k') = the rotation (or its transpose) of q [s, b, hq, d] and k [s, b, hk, d]; k may be None."""
    q = _last_dense(q)
    k = _last_dense(k) if k is not None else None
    S, B, HQ, D = q.shape
    HK = k.shape[2] if k is not None else 0
    rot = cos.shape[-1]
    qo = torch.empty((S, B, HQ, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((S, B, HK, D), dtype=k.dtype, device=k.device) if k is not None else qo
    cq = cos.expand(S, B, HQ, rot).stride()
    ck = cos.expand(S, B, HK, rot).stride() if k is not None else cq
    kk = k if k is not None else q
    block_d = _runtime.pow2(D)
    block_h = max(1, min(_runtime.pow2(max(HQ, HK)), TILE // block_d))
    grid = (S * B, -(-max(HQ, HK) // block_h))
    if S * B and D:
        _k()._rope[grid](q, kk, qo, ko, cos, sin,
                         q.stride(0), q.stride(1), q.stride(2), kk.stride(0), kk.stride(1), kk.stride(2),
                         qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
                         cq[0], cq[1], cq[2], ck[0], ck[1], ck[2],
                         B, HQ, HK, D, rot,
                         BACKWARD=backward, INTERLEAVED=interleaved, BLOCK_H=block_h, BLOCK_D=block_d,
                         num_warps=_runtime.warps(block_h * block_d))
    return qo, (ko if k is not None else None)


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, interleaved):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved, ctx.has_k = interleaved, k is not None
        return _launch(q, k, cos, sin, interleaved, backward=False)

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        dq, dk = _launch(gq, gk if ctx.has_k else None, cos, sin, ctx.interleaved, backward=True)
        return dq, dk, None, None, None


def supports(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether the kernel takes this call (else the reference runs)."""
    return supported(t, freqs) and freqs.device == t.device and _runtime.supported_dtype(t)


def supports_qk(q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether `rotary_pos_emb_qk` takes q and k in one launch (same dtype, s, b and d; heads may differ)."""
    return (supports(q, freqs) and supports(k, freqs) and q.dtype == k.dtype and q.shape[:2] == k.shape[:2]
            and q.shape[-1] == k.shape[-1])


def _tables(t, freqs, mscale):
    """fp32 cos/sin of Megatron's rounding (to t's dtype), contiguous for the kernel's strides."""
    cos, sin = cached_cos_sin(t, freqs, mscale, torch.float32)
    return cos.contiguous(), sin.contiguous()


def rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False,
                   mscale: float = 1.0) -> torch.Tensor:
    """Megatron's rotary embedding of t [s, b, h, d] by the angles `freqs`."""
    if not supports(t, freqs):
        return rotary_pos_emb_reference(t, freqs, interleaved, mscale)
    _runtime.check_runs_on("rope", t, freqs)
    cos, sin = _tables(t, freqs, mscale)
    return _RoPE.apply(t, None, cos, sin, bool(interleaved))[0]


def rotary_pos_emb_qk(q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False,
                      mscale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotary_pos_emb(q, freqs), rotary_pos_emb(k, freqs)) in one kernel launch each way.

    q [s, b, hq, d] and k [s, b, hk, d] (hk may differ: GQA) share s, b, d and the angles."""
    if not supports_qk(q, k, freqs):
        return (rotary_pos_emb(q, freqs, interleaved, mscale), rotary_pos_emb(k, freqs, interleaved, mscale))
    _runtime.check_runs_on("rope", q, k, freqs)
    cos, sin = _tables(q, freqs, mscale)
    return _RoPE.apply(q, k, cos, sin, bool(interleaved))
