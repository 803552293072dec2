"""MoE token permute / unpermute in Triton, with Megatron-Core's contract as
`npuspeed.ops.moe_permute` states it.

permute: rows grouped by expert, tokens ascending within an expert (the order of Megatron's
masked_select over the transposed routing map, here `nonzero` of the transposed view: no dense
[E, T] copy), then one gather kernel copies the rows. unpermute: each token's rows are found
through a token-major index (a stable argsort of sorted_indices, so a token's rows stay in
expert order) and one program per (token, column block) sums them, weighted by their
probabilities, in fp32 and in Megatron's order (expert ascending): no atomics, the same bits
on every run. Backward of permute is that sum unweighted; backward of unpermute is a weighted
gather plus, for the probabilities, a per-row dot product.

The reduction's trip count is a constexpr bound on rows per token (the next power of two of
the largest count, read once per call: a device sync, as Megatron's masked_select has).
"""
from __future__ import annotations

import torch

from npuspeed.ops.moe_permute import permute_reference, unpermute_reference
from npuspeed.ops.triton import _runtime
from npuspeed.ops.triton._runtime import available  # noqa: F401  (public probe)

tl = None  # triton.language, bound by _runtime.kernels() on first use
BLOCK_CAP = 1024


def _gather(SRC, IDX, W, DST, ssrc, sdst, H, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """DST[r] = SRC[IDX[r]] (* W[r])."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    src = tl.load(IDX + r).to(tl.int64)
    x = tl.load(SRC + src * ssrc + cols, mask=mask, other=0.0)
    if HAS_W:
        x = x.to(tl.float32) * tl.load(W + r).to(tl.float32)
    tl.store(DST + r * sdst + cols, x.to(DST.dtype.element_ty), mask=mask)


def _row_dot(A, IDX, Bm, OUT, sa, sb, H, NCB: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[r] = sum_h A[IDX[r], h] * Bm[r, h] in fp32."""
    r = tl.program_id(0).to(tl.int64)
    src = tl.load(IDX + r).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for cb in range(NCB):
        cols = cb * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        a = tl.load(A + src * sa + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(Bm + r * sb + cols, mask=mask, other=0.0).to(tl.float32)
        acc += a * b
    tl.store(OUT + r, tl.sum(acc, axis=0).to(OUT.dtype.element_ty))


def _reduce(SRC, ORDER, STARTS, COUNTS, W, DST, ssrc, sdst, H,
            HAS_W: tl.constexpr, MAX_K: tl.constexpr, BLOCK: tl.constexpr):
    """DST[t] = sum over token t's rows j (expert order) of SRC[row_j] (* W[row_j]), fp32."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    start = tl.load(STARTS + t)
    count = tl.load(COUNTS + t)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(MAX_K):
        live = j < count
        row = tl.load(ORDER + start + j, mask=live, other=0).to(tl.int64)
        x = tl.load(SRC + row * ssrc + cols, mask=cols < tl.where(live, H, 0), other=0.0).to(tl.float32)
        if HAS_W:
            x = x * tl.load(W + row, mask=live, other=0.0).to(tl.float32)
        acc += x
    tl.store(DST + t * sdst + cols, acc.to(DST.dtype.element_ty), mask=mask)


def _k():
    import sys

    return _runtime.kernels(sys.modules[__name__], ("_gather", "_row_dot", "_reduce"))


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _gather_rows(src, idx, w, out_dtype):
    n, h = idx.shape[0], src.shape[1]
    dst = torch.empty((n, h), dtype=out_dtype, device=src.device)
    if n and h:
        blk = _runtime.block(h, BLOCK_CAP)
        _k()._gather[(n, -(-h // blk))](src, idx, w if w is not None else idx, dst, src.stride(0), dst.stride(0), h,
                                        HAS_W=w is not None, BLOCK=blk, num_warps=_runtime.warps(blk))
    return dst


def _token_index(sorted_indices, num_tokens):
    """(rows in token-major order, first position of each token, rows per token, MAX_K)."""
    order = torch.argsort(sorted_indices, stable=True)
    counts = torch.zeros(num_tokens, dtype=torch.int64, device=sorted_indices.device)
    counts.scatter_add_(0, sorted_indices, torch.ones_like(sorted_indices))
    starts = torch.cumsum(counts, 0) - counts
    max_k = int(counts.max()) if num_tokens else 0
    return order, starts, counts, _runtime.pow2(max_k) if max_k else 0


def _sum_rows(src, sorted_indices, w, num_tokens, out_dtype):
    h = src.shape[1]
    dst = torch.empty((num_tokens, h), dtype=out_dtype, device=src.device)
    order, starts, counts, max_k = _token_index(sorted_indices, num_tokens)
    if max_k == 0 or h == 0:
        return dst.zero_()
    blk = _runtime.block(h, BLOCK_CAP)
    _k()._reduce[(num_tokens, -(-h // blk))](src, order, starts, counts, w if w is not None else counts, dst,
                                             src.stride(0), dst.stride(0), h, HAS_W=w is not None, MAX_K=max_k,
                                             BLOCK=blk, num_warps=_runtime.warps(blk))
    return dst


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, sorted_indices, num_tokens):
        ctx.save_for_backward(sorted_indices)
        ctx.num_tokens = num_tokens
        return _gather_rows(_dense(tokens), sorted_indices, None, tokens.dtype)

    @staticmethod
    def backward(ctx, grad):
        (sorted_indices,) = ctx.saved_tensors
        return _sum_rows(_dense(grad), sorted_indices, None, ctx.num_tokens, grad.dtype), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted, sorted_indices, row_probs, num_tokens):
        permuted = _dense(permuted)
        ctx.save_for_backward(sorted_indices, row_probs, permuted if ctx.needs_input_grad[2] else None)
        return _sum_rows(permuted, sorted_indices, row_probs, num_tokens, permuted.dtype)

    @staticmethod
    def backward(ctx, grad):
        sorted_indices, row_probs, permuted = ctx.saved_tensors
        grad = _dense(grad)
        d_permuted = _gather_rows(grad, sorted_indices, row_probs, grad.dtype) if ctx.needs_input_grad[0] else None
        d_probs = None
        if ctx.needs_input_grad[2]:
            n, h = permuted.shape
            d_probs = torch.empty(n, dtype=row_probs.dtype, device=row_probs.device)
            if n:
                blk = _runtime.block(h, BLOCK_CAP)
                _k()._row_dot[(n,)](grad, sorted_indices, permuted, d_probs, grad.stride(0), permuted.stride(0), h,
                                    NCB=max(-(-h // blk), 1), BLOCK=blk, num_warps=_runtime.warps(blk))
        return d_permuted, None, d_probs, None


def supports(tokens: torch.Tensor, row_probs: torch.Tensor | None = None) -> bool:
    """Whether the kernels take these [rows, H] tokens (and [N] row probabilities); else the references run."""
    return tokens.dim() == 2 and _runtime.supported_dtype(*((tokens,) if row_probs is None else (tokens, row_probs)))


def permute(tokens: torch.Tensor, routing_map: torch.Tensor):
    """(permuted [N, H], sorted_indices [N], tokens_per_expert [E]), as `permute_reference`."""
    if not supports(tokens):
        return permute_reference(tokens, routing_map)
    _runtime.check_runs_on("moe_permute", tokens, routing_map)
    sorted_indices = routing_map.bool().T.nonzero()[:, 1]
    permuted = _Permute.apply(tokens, sorted_indices, tokens.shape[0])
    return permuted, sorted_indices, routing_map.sum(dim=0).long()


def unpermute(permuted: torch.Tensor, sorted_indices: torch.Tensor, row_probs: torch.Tensor | None,
              num_tokens: int) -> torch.Tensor:
    """[num_tokens, H]: each token's rows summed, weighted by `row_probs` [N], as `unpermute_reference`."""
    if not supports(permuted, row_probs):
        return unpermute_reference(permuted, sorted_indices, row_probs, num_tokens)
    _runtime.check_runs_on("moe_unpermute", permuted, sorted_indices, *(() if row_probs is None else (row_probs,)))
    return _Unpermute.apply(permuted, sorted_indices, row_probs, int(num_tokens))


def _row_probs(probs, sorted_indices, routing_map):
    counts = routing_map.sum(dim=0).to(probs.device)
    experts = torch.repeat_interleave(torch.arange(counts.numel(), device=probs.device), counts)
    return probs[sorted_indices, experts]


def moe_permute(tokens, routing_map, probs=None, *, num_out_tokens=None, drop_and_pad=False):
    """(permuted [N, H], permuted_probs [N] or None, sorted_indices [N], tokens_per_expert [E]),
    as `npuspeed.ops.moe_permute.moe_permute` off NPU (num_out_tokens and drop_and_pad are
    accepted and, as there, not needed: the map already holds each expert's rows)."""
    permuted, sorted_indices, tokens_per_expert = permute(tokens, routing_map)
    permuted_probs = None if probs is None else _row_probs(probs, sorted_indices, routing_map)
    return permuted, permuted_probs, sorted_indices, tokens_per_expert


def moe_unpermute(permuted, sorted_indices, num_tokens: int, probs=None, routing_map=None, *, drop_and_pad=False):
    """[num_tokens, H]: each token's rows summed (weighted by `probs` [T, E] when given), as
    `npuspeed.ops.moe_permute.moe_unpermute` off NPU."""
    if probs is not None and routing_map is None:
        raise ValueError("moe_unpermute: weighting by probs needs the routing_map that permuted the tokens")
    row_probs = None if probs is None else _row_probs(probs, sorted_indices, routing_map)
    return unpermute(permuted, sorted_indices, row_probs, int(num_tokens))
