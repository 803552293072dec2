"""Packed documents: where each document of a micro-batch starts and ends, never an S x S mask.

Boundaries reach attention through Megatron's own `PackedSeqParams`, the argument GPTModel
already carries to every core attention call. npuspeed reads two forms:

- qkv_format "sbhd" (what the example builds with --reset-attention-mask): tensors keep
  Megatron's [s, b, h, d]; `cu_seqlens_q` is int32 [n + 1], the cumulative document ends
  over the batch-major flattening of the *whole* [b, S] micro-batch (0 first, b * S last,
  every row end a boundary: the TND convention of npu_fusion_attention and varlen flash
  kernels), computed before `get_batch_on_this_cp_rank` cuts the sequence, so every CP rank
  gets the same global boundaries; `max_seqlen_q` = S. Megatron's RoPE stays per CP rank as
  without documents (positions restart per document for the embedding only when
  --reset-position-ids gives such position ids; rotary scores depend on relative positions
  only, and attention never crosses a document, so the result is the same).
- qkv_format "thd" (Megatron's packed format, micro-batch 1, tensors [t, h, d]) without CP.

Each position then sees keys [start, end) of its own document (clipped by causality).
Kernels that take per-row key ranges get them as int32 [b, sq] slices (`ranges`); the others
get the block's document pieces (`tiles`): NPU's npu_fusion_attention takes them all in one
TND (varlen) call (npuspeed/ops/npu/varlen.py), a kernel without varlen runs one dense call per piece.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from npuspeed.features.base import FeatureError


@dataclass
class Documents:
    starts: torch.Tensor  # int32 [b, S]: global start of each position's document
    ends: torch.Tensor  # int32 [b, S]: one past its last position
    bounds: list[list[int]]  # per batch row: sorted boundaries 0 = x0 < x1 < ... = S
    count: int  # documents in the micro-batch


_CACHE: dict = {"ref": None, "key": None, "docs": None}


def from_cu_seqlens(cu: torch.Tensor, b: int, s: int) -> Documents:
    """cu: cumulative ends over the [b, s] batch flattened batch-major (see module docstring)."""
    flat = [int(x) for x in cu.detach().cpu().tolist()]
    if flat[0] != 0 or flat[-1] != b * s or any(y <= x for x, y in zip(flat, flat[1:])):
        raise FeatureError(
            f"--reset-attention-mask: cu_seqlens_q must rise strictly from 0 to b * S = {b * s} "
            f"(got {flat[:4]}...{flat[-2:]}); build it over the whole micro-batch before the CP split")
    cuts = sorted(set(flat) | {r * s for r in range(b + 1)})
    bounds = [[x - r * s for x in cuts if r * s <= x <= (r + 1) * s] for r in range(b)]
    starts = torch.empty(b, s, dtype=torch.int32)
    ends = torch.empty(b, s, dtype=torch.int32)
    for r, row in enumerate(bounds):
        for lo, hi in zip(row, row[1:]):
            starts[r, lo:hi] = lo
            ends[r, lo:hi] = hi
    return Documents(starts, ends, bounds, len(cuts) - 1)


def from_packed(params, b: int, s: int, device) -> Documents:
    """The documents of `params` (PackedSeqParams) for a [b, s] micro-batch, cached per tensor:
    every layer of a micro-batch gets the same object."""
    cu = params.cu_seqlens_q
    if cu is None:
        raise FeatureError("--use-flash-attn: PackedSeqParams without cu_seqlens_q; give the document "
                           "boundaries (cumulative lengths) or drop packed_seq_params")
    if params.cu_seqlens_kv is not None and params.cu_seqlens_kv is not cu and not torch.equal(
            params.cu_seqlens_kv.cpu(), cu.cpu()):
        raise FeatureError("--use-flash-attn: packed self-attention needs cu_seqlens_kv == cu_seqlens_q")
    padded = getattr(params, "cu_seqlens_q_padded", None)
    if padded is not None and not torch.equal(padded.cpu(), cu.cpu()):
        raise FeatureError("--use-flash-attn: padded packed sequences (cu_seqlens_q_padded != "
                           "cu_seqlens_q) are not supported; pack documents without padding")
    key = (getattr(cu, "_version", None), b, s, str(device))
    ref = _CACHE["ref"]
    if ref is not None and ref() is cu and _CACHE["key"] == key:
        return _CACHE["docs"]
    docs = from_cu_seqlens(cu, b, s)
    docs.starts, docs.ends = docs.starts.to(device), docs.ends.to(device)
    _CACHE.update(ref=weakref.ref(cu), key=key, docs=docs)
    return docs


def ranges(docs: Documents, q0: int, sq: int, causal: bool):
    """key_lo, key_hi (int32 [b, sq], global key positions) for queries [q0, q0 + sq)."""
    lo = docs.starts[:, q0:q0 + sq]
    return lo, None if causal else docs.ends[:, q0:q0 + sq]


def visible(docs: Documents, q0: int, sq: int, k0: int, sk: int) -> bool:
    """Does any query in [q0, q0+sq) share a document with any key in [k0, k0+sk)?"""
    for row in docs.bounds:
        for lo, hi in zip(row, row[1:]):
            if lo < q0 + sq and hi > q0 and lo < k0 + sk and hi > k0:
                return True
    return False


def tiles(docs: Documents, q0: int, sq: int, k0: int, sk: int) -> list[list[tuple[int, int, int, int]]]:
    """Per batch row, the (q_begin, q_end, k_begin, k_end) local pieces of each document that
    has queries in [q0, q0 + sq) and keys in [k0, k0 + sk)."""
    out = []
    for row in docs.bounds:
        pieces = []
        for lo, hi in zip(row, row[1:]):
            qa, qb = max(lo, q0), min(hi, q0 + sq)
            ka, kb = max(lo, k0), min(hi, k0 + sk)
            if qa < qb and ka < kb:
                pieces.append((qa - q0, qb - q0, ka - k0, kb - k0))
        out.append(pieces)
    return out
