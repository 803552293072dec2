"""Per-row key ranges for the flash attention kernels: masks said in O(b x S), not S x S.

Each query row i of batch row b may see the global key positions [key_lo[b, i], key_hi[b, i])
(int32 [b, sq], any strides), on top of causal. This module turns the patterns Megatron
builds into ranges: key padding (lengths), bands (sliding windows, --pre/--next-tockens),
packed documents (cu_seqlens or a per-position document start: each query sees its own
document only), and any boolean mask whose allowed keys form one interval per row
(`mask_to_bounds`, e.g. causal | key padding, a block-diagonal causal mask).
"""
from __future__ import annotations

import torch


def _int32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int32)


def from_lengths(lengths: torch.Tensor, sq: int) -> tuple[None, torch.Tensor]:
    """Key padding: batch row b sees keys [0, lengths[b]) -> (None, key_hi [b, sq] expanded)."""
    return None, _int32(lengths.reshape(-1, 1)).expand(-1, sq)


def from_band(b: int, sq: int, sk: int, band: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Query i sees key j iff -left <= j - i - (sk - sq) <= right (the MaskPlan band)."""
    left, right = band
    i = torch.arange(sq, dtype=torch.int64) + (sk - sq)
    lo = (i - left).clamp(0, sk)
    hi = (i + right + 1).clamp(0, sk)
    return _int32(lo)[None].expand(b, sq), _int32(hi)[None].expand(b, sq)


def from_cu_seqlens(cu_seqlens: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed documents. cu_seqlens: [n + 1] (one layout for every batch row) or [b, n + 1]
    cumulative document lengths (0 first, s last) -> each position sees its own document."""
    cu = cu_seqlens if cu_seqlens.dim() == 2 else cu_seqlens[None]
    cu = cu.to(torch.int64)
    pos = torch.arange(s, dtype=torch.int64)
    # the document of position p: the last boundary <= p
    doc = torch.searchsorted(cu.contiguous(), pos.expand(cu.shape[0], s).contiguous(), right=True) - 1
    lo = torch.gather(cu, 1, doc.clamp(0, cu.shape[1] - 1))
    hi = torch.gather(cu, 1, (doc + 1).clamp(0, cu.shape[1] - 1))
    return _int32(lo), _int32(hi)


def from_document_starts(starts: torch.Tensor, ends: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packed documents given per position: starts[b, i] = first position of i's document
    (ends[b, i] = one past its last; None when causal alone bounds the row)."""
    return _int32(starts), None if ends is None else _int32(ends)


def mask_to_bounds(mask: torch.Tensor, sq: int, sk: int):
    """A boolean mask (True = masked out, Megatron's polarity) broadcastable to [b, 1, sq, sk]
    -> (key_lo, key_hi, dead [b, sq] bool) when every row's allowed keys are one interval,
    else None. `dead` marks rows with no key (Megatron gives them the mean of V)."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[-1:]) != (sk,):
        return None
    if mask.shape[2] not in (1, sq):
        return None
    allowed = ~mask[:, 0]  # [b, sq or 1, sk]
    count = allowed.sum(-1, dtype=torch.int32)
    first = allowed.to(torch.uint8).argmax(-1).to(torch.int32)
    last = (sk - allowed.flip(-1).to(torch.uint8).argmax(-1)).to(torch.int32)
    dead = count == 0
    if not bool(torch.equal(torch.where(dead, 0, last - first), count)):
        return None  # some row's keys are not one interval
    lo = torch.where(dead, 0, first)
    hi = torch.where(dead, 0, last)
    b = mask.shape[0]
    return lo.expand(b, sq), hi.expand(b, sq), dead.expand(b, sq)
