"""Packed documents (--reset-attention-mask, --reset-position-ids, --eod-mask-loss) and CP batches.

A sample packs several documents, each ending with the EoD token (Megatron-LM's convention:
the EoD belongs to the document it ends; the next one starts after it). With
--reset-attention-mask a token attends only inside its document:

- with --use-flash-attn the boundaries go to attention as Megatron's PackedSeqParams
  (qkv_format "sbhd", cu_seqlens over the batch-major flattened [b, S] micro-batch): no
  S x S mask anywhere, and under context parallelism every CP rank gets the same global
  boundaries (they are computed before the batch is cut);
- without it, Megatron's unfused attention needs the [b, 1, S, S] mask, built here as
  Megatron-LM's `get_ltor_masks_and_position_ids` builds it (the reference path).

`cp_split` cuts the batch with Megatron's own `get_batch_on_this_cp_rank` (chunks i and
2N-1-i of the sequence; from megatron-core 0.18 it takes `is_hybrid_cp`, Megatron's own
dynamic-length hybrid CP, not npuspeed's hybrid_cp_algo: False here, and needs the CP group).
"""
from __future__ import annotations

import numpy as np
import torch


def mock_documents(rng: np.random.Generator, length: int, mean: int, n: int, eod: int, rules) -> np.ndarray:
    """`length` tokens of documents about `mean` long (uniform in [mean/2, 3 mean/2]), each one
    affine rule mod n (as the one-document samples) ended by `eod`."""
    text = np.empty(length, dtype=np.int64)
    pos = 0
    while pos < length:
        size = int(rng.integers(max(2, mean // 2), max(3, 3 * mean // 2) + 1))
        a, c = rules[int(rng.integers(len(rules)))]
        tok = int(rng.integers(n))
        for t in range(min(size - 1, length - pos)):
            text[pos + t] = tok
            tok = (a * tok + c) % n
        pos += size - 1
        if pos < length:
            text[pos] = eod
            pos += 1
    return text


def reset_positions(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Position ids restarting at 0 after every EoD ([b, s] int64)."""
    b, s = tokens.shape
    pos = torch.arange(s, dtype=torch.int64).expand(b, s).clone()
    for row in range(b):
        for i in (tokens[row] == eod).nonzero().flatten().tolist():
            if i + 1 < s:
                pos[row, i + 1:] -= pos[row, i + 1].item()
    return pos


def cu_seqlens(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """int32 cumulative document ends over the batch-major flattening of tokens [b, s]."""
    b, s = tokens.shape
    ends = [0]
    for row in range(b):
        cuts = [i + 1 for i in (tokens[row] == eod).nonzero().flatten().tolist() if i + 1 < s]
        ends += [row * s + c for c in cuts] + [(row + 1) * s]
    return torch.tensor(ends, dtype=torch.int32)


def packed_seq_params(tokens: torch.Tensor, eod: int):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens(tokens, eod)
    s = tokens.shape[1]
    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s)


def document_mask(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, 1, s, s] bool, True = masked: causal and no attention across an EoD (reference only).

    Built where `tokens` lives, without host loops: a token's document index is the number of
    EoDs before it, and query i sees key j <= i only within its own document. On an
    accelerator the mask is thus made on the device (no S x S host tensor, no copy)."""
    b, s = tokens.shape
    ends = (tokens == eod).to(torch.int32)
    doc = torch.cumsum(ends, dim=1) - ends  # EoDs strictly before each position
    causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).triu_(1)
    return (causal | (doc[:, :, None] != doc[:, None, :])).unsqueeze(1)


def cp_split(batch: dict) -> dict:
    """This CP rank's part of every [b, s] tensor (and of a [b, 1, s, s] mask's rows)."""
    import inspect

    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    params = inspect.signature(get_batch_on_this_cp_rank).parameters
    kwargs = {"is_hybrid_cp": False} if "is_hybrid_cp" in params else {}
    if "cp_group" in params:  # 0.18+ would cut over the whole world without it
        kwargs["cp_group"] = parallel_state.get_context_parallel_group()
    return get_batch_on_this_cp_rank(batch, **kwargs)
