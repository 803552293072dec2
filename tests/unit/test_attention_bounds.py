"""Masks as per-row key ranges (npuspeed/ops/attention_bounds.py): what the CPU kernels take
instead of an S x S mask. Each helper is checked against the boolean mask it stands for."""
from __future__ import annotations

import torch

from npuspeed.ops import attention_bounds as ab


def allowed(lo, hi, sk):
    """[b, sq, sk] boolean (True = may attend) of per-row ranges."""
    j = torch.arange(sk)
    lo = torch.zeros(hi.shape, dtype=torch.int32) if lo is None else lo
    return (j >= lo[..., None].long()) & (j < hi[..., None].long())


def test_lengths_band_and_documents_match_their_masks():
    lo, hi = ab.from_lengths(torch.tensor([5, 9]), 9)
    assert lo is None and hi.shape == (2, 9) and hi.stride(1) == 0
    assert torch.equal(allowed(lo, hi, 9)[0, 3], torch.arange(9) < 5)
    lo, hi = ab.from_band(2, 6, 6, (2, 1))
    rel = torch.arange(6)[None, :] - torch.arange(6)[:, None]
    assert torch.equal(allowed(lo, hi, 6)[1], (rel >= -2) & (rel <= 1))
    lo, hi = ab.from_cu_seqlens(torch.tensor([0, 3, 4, 8]), 8)
    doc = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2])
    assert torch.equal(allowed(lo, hi, 8)[0], doc[:, None] == doc[None, :])
    starts, _ = ab.from_document_starts(torch.tensor([[0, 0, 2, 2]]))
    assert starts.dtype == torch.int32


def test_interval_masks_become_ranges_and_others_do_not():
    s = 7
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    pad = torch.arange(s)[None, :] >= torch.tensor([7, 4])[:, None]  # key padding, True = masked
    mask = (causal[None] | pad[:, None, :])[:, None]  # [b, 1, s, s]: causal | key padding
    lo, hi, dead = ab.mask_to_bounds(mask, s, s)
    assert torch.equal(allowed(lo, hi, s), ~mask[:, 0]) and not bool(dead.any())
    lo, hi, dead = ab.mask_to_bounds(pad[:, None, None, :], s, s)  # [b, 1, 1, s]
    assert torch.equal(allowed(lo, hi, s), ~pad[:, None, :].expand(2, s, s))
    doc = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    packed = ~((doc[:, None] == doc[None, :]) & ~causal)  # block-diagonal causal documents
    lo, hi, _ = ab.mask_to_bounds(packed[None, None], s, s)
    assert torch.equal(allowed(lo, hi, s)[0], ~packed)
    holes = torch.zeros(1, 1, s, s, dtype=torch.bool)
    holes[..., 3, 2] = True  # row 3 sees keys 0, 1, 3..6: not one interval
    assert ab.mask_to_bounds(holes, s, s) is None
    per_head = torch.zeros(1, 2, s, s, dtype=torch.bool)
    assert ab.mask_to_bounds(per_head, s, s) is None


def test_fully_masked_rows_are_dead():
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    mask[..., 2, :] = True
    lo, hi, dead = ab.mask_to_bounds(mask, 4, 4)
    assert dead.tolist() == [[False, False, True, False]] and int(hi[0, 2]) <= int(lo[0, 2])
