"""A block of packed documents as ONE `npu_fusion_attention` call: the TND (varlen) layout.

A block (queries [q0, q0 + sq), keys [k0, k0 + sk), b rows) carries, per row, the piece of
each document that has queries and keys in it (`Block.tiles`, from documents.tiles). Each
piece becomes one TND sequence: its queries gathered token-major out of the [sq, b] rows
(flat index s * b + row), its keys likewise, and actual_seq_qlen / actual_seq_kvlen are the
cumulative piece lengths (host lists of END offsets, no leading 0: lengths 2 2 2 -> 2 4 6),
as varlen flash kernels take cu_seqlens. The op attends each sequence to its own keys only,
so a block costs one launch whatever its documents, and nothing S x S exists. A causal
(diagonal) block's pieces are square, causal per piece (sparse_mode 3 with the compressed
mask); an off-diagonal ring block pairs a query piece with a key piece of another length,
fully visible. Rows in no piece keep out 0 and lse -inf.

softmax_max / softmax_sum come back shaped [T, N, 8], but by default each sequence's values
are stored in turn as [N, len, 8] (head-major; MindSpeed's `flatten_softmax` undoes the same
order; the token-major order needs softmax_layout="TND", first in torch_npu 2.9.0's schema).
`stat_index` maps (token, head) to that storage, both ways. The op takes at most
MAX_SEQUENCES sequences per call (its documented varlen batch limit); a block with more pieces
makes more calls. `lib`: the op library (npuspeed.ops.npu.library; a stand-in in the tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from npuspeed import telemetry
from npuspeed.ops.npu import library

MAX_SEQUENCES = 1024
CALLS = "cp.varlen.calls"  # npu_fusion_attention TND calls (forward)
SEQUENCES = "cp.varlen.sequences"  # document pieces they covered


@dataclass
class Packing:
    q_index: torch.Tensor  # int64 [T]: rows of q.reshape(sq * b, ...) in TND order
    k_index: torch.Tensor  # int64 [Tk]
    cu_q: list[int]  # actual_seq_qlen
    cu_k: list[int]  # actual_seq_kvlen
    stat_index: torch.Tensor  # int64 [T, N]: storage position of (token, head) in softmax_max


def _pieces(tiles, b: int):
    return [(row, piece) for row in range(b) for piece in tiles[row]]


def pack(tiles, b: int, heads: int, device) -> list[Packing]:
    """The TND calls of one block: one Packing per MAX_SEQUENCES document pieces."""
    pieces = _pieces(tiles, b)
    return [_pack(pieces[i:i + MAX_SEQUENCES], b, heads, device) for i in range(0, len(pieces), MAX_SEQUENCES)]


def _pack(pieces, b: int, heads: int, device) -> Packing:
    q_parts, k_parts, cu_q, cu_k, lengths = [], [], [], [], []
    tq = tk = 0
    for row, (qa, qb, ka, kb) in pieces:
        q_parts.append(torch.arange(qa, qb) * b + row)
        k_parts.append(torch.arange(ka, kb) * b + row)
        tq, tk = tq + qb - qa, tk + kb - ka
        cu_q.append(tq)
        cu_k.append(tk)
        lengths.append(qb - qa)
    length = torch.tensor(lengths).repeat_interleave(torch.tensor(lengths))  # per token: its sequence's length
    start = torch.tensor([0] + cu_q[:-1]).repeat_interleave(torch.tensor(lengths))
    token = torch.arange(tq)
    stat = start[:, None] * heads + torch.arange(heads)[None, :] * length[:, None] + (token - start)[:, None]
    return Packing(torch.cat(q_parts).to(device), torch.cat(k_parts).to(device), cu_q, cu_k, stat.to(device))


def mask_args(causal: bool, compressed_mask) -> dict:
    """Causal per piece: rightDownCausal (sparse_mode 3) on the compressed 2048 x 2048 mask."""
    return {"atten_mask": compressed_mask, "sparse_mode": 3} if causal else {"atten_mask": None, "sparse_mode": 0}


def lse_from_stats(smax: torch.Tensor, ssum: torch.Tensor, p: Packing) -> torch.Tensor:
    """[T, N] log-sum-exp from the op's softmax_max / softmax_sum in their storage order."""
    m = smax[..., 0].reshape(-1)[p.stat_index]
    s = ssum[..., 0].reshape(-1)[p.stat_index]
    return m.float() + torch.log(s.float())


def stats_from_lse(lse_t: torch.Tensor, p: Packing) -> torch.Tensor:
    """The inverse: [T, N] -> a softmax_max [T, N, 8] (stored as the op stores it) whose
    sum is 1, so the gradient op's P = exp(s - lse) uses the final merged LSE."""
    t, n = lse_t.shape
    flat = torch.empty(t * n, dtype=torch.float32, device=lse_t.device)
    flat[p.stat_index.reshape(-1)] = lse_t.reshape(-1).float()
    return flat.view(t, n, 1).expand(t, n, 8).contiguous()


def forward(lib, q, k, v, causal: bool, tiles, scale: float, compressed_mask, keep_prob: float = 1.0,
            rng_states: list | None = None):
    """q [sq, b, hq, d], k/v [sk, b, hk, d] -> out [sq, b, hq, d], lse [b, hq, sq] fp32.
    With keep_prob < 1 the op draws dropout itself; each call's (seed, offset, numels) is
    appended to `rng_states` for the backward of the same call."""
    sq, b, hq, d = q.shape
    sk, hk = k.shape[0], k.shape[2]
    out = torch.zeros((sq * b, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.full((sq * b, hq), float("-inf"), dtype=torch.float32, device=q.device)
    qf, kf, vf = q.reshape(sq * b, hq, d), k.reshape(sk * b, hk, d), v.reshape(sk * b, hk, d)
    for p in pack(tiles, b, hq, q.device):
        res = library(lib).npu_fusion_attention(
            qf.index_select(0, p.q_index), kf.index_select(0, p.k_index), vf.index_select(0, p.k_index), hq, "TND",
            scale=scale, keep_prob=keep_prob, actual_seq_qlen=p.cu_q, actual_seq_kvlen=p.cu_k,
            **mask_args(causal, compressed_mask))
        if rng_states is not None:
            rng_states.append(rng_kwargs(res))
        out.index_copy_(0, p.q_index, res[0])
        lse.index_copy_(0, p.q_index, lse_from_stats(res[1], res[2], p))
        telemetry.count(CALLS)
        telemetry.count(SEQUENCES, len(p.cu_q))
    return out.view(sq, b, hq, d), lse.view(sq, b, hq).permute(1, 2, 0).contiguous()


def rng_kwargs(res) -> dict:
    """The dropout state `npu_fusion_attention` returns, as its grad op takes it back."""
    return {"seed": res[4], "offset": res[5], "numels": res[6]}


def backward(lib, dout, q, k, v, out, lse, causal: bool, tiles, scale: float, compressed_mask,
             keep_prob: float = 1.0, rng_states: list | None = None):
    """Gradients from the final out / LSE (FlashAttention-2's backward), one call per Packing;
    `rng_states`: the forward's per-call dropout states, in call order."""
    sq, b, hq, d = q.shape
    sk, hk = k.shape[0], k.shape[2]
    dq = torch.zeros((sq * b, hq, d), dtype=q.dtype, device=q.device)
    dk = torch.zeros((sk * b, hk, d), dtype=k.dtype, device=k.device)
    dv = torch.zeros((sk * b, hk, d), dtype=v.dtype, device=v.device)
    qf, kf, vf = q.reshape(sq * b, hq, d), k.reshape(sk * b, hk, d), v.reshape(sk * b, hk, d)
    gf, of = dout.reshape(sq * b, hq, d), out.reshape(sq * b, hq, d)
    lse_sb = lse.permute(2, 0, 1).reshape(sq * b, hq)
    for i, p in enumerate(pack(tiles, b, hq, q.device)):
        smax = stats_from_lse(lse_sb.index_select(0, p.q_index), p)
        grads = library(lib).npu_fusion_attention_grad(
            qf.index_select(0, p.q_index), kf.index_select(0, p.k_index), vf.index_select(0, p.k_index),
            gf.index_select(0, p.q_index), hq, "TND", softmax_max=smax, softmax_sum=torch.ones_like(smax),
            attention_in=of.index_select(0, p.q_index), scale_value=scale, keep_prob=keep_prob,
            actual_seq_qlen=p.cu_q, actual_seq_kvlen=p.cu_k, **mask_args(causal, compressed_mask),
            **(rng_states[i] if rng_states is not None else {}))
        dq.index_copy_(0, p.q_index, grads[0])  # pieces of one block never share a query or key
        dk.index_copy_(0, p.k_index, grads[1])
        dv.index_copy_(0, p.k_index, grads[2])
    return dq.view(sq, b, hq, d), dk.view(sk, b, hk, d), dv.view(sk, b, hk, d)
