"""EMULATOR (not the real op) internals for input_layout "TND" (varlen): the documented
actual_seq_qlen / actual_seq_kvlen and the storage of softmax_max / softmax_sum."""
from __future__ import annotations

import torch

from npu_contract.emulate_attention_core import MAX_SEQUENCES, MAX_T


def _strip_tail(cu: list[int]) -> tuple[list[int], int]:
    """Trailing batches that take no part are passed as trailing 0s (2.9.0 / 2.14.0 docs:
    lengths [2, 3, 4, 5, 6], last two not computed -> [2, 5, 9, 0, 0])."""
    tail = 0
    while len(cu) - tail > 1 and cu[len(cu) - tail - 1] == 0 and any(cu[:len(cu) - tail - 1]):
        tail += 1
    return cu[:len(cu) - tail], tail


def sequences(actual_seq_qlen, actual_seq_kvlen, t_q: int, t_k: int):
    """[(q_begin, q_end, k_begin, k_end)] of the sequences that take part, from the cumulative
    end offsets (host lists, no leading 0; a length may be 0: [2, 4, 4, 6, 8])."""
    if actual_seq_qlen is None or actual_seq_kvlen is None:
        raise ValueError("input_layout TND needs actual_seq_qlen and actual_seq_kvlen")
    if not (1 <= t_q <= MAX_T and 1 <= t_k <= MAX_T):
        raise ValueError(f"TND: T must be in 1..{MAX_T} (got {t_q}, {t_k})")
    ends, tails = [], []
    for name, cu, total in (("actual_seq_qlen", actual_seq_qlen, t_q), ("actual_seq_kvlen", actual_seq_kvlen, t_k)):
        if isinstance(cu, torch.Tensor) or not all(isinstance(x, int) for x in cu):
            raise TypeError(f"{name} must be a host list of ints")
        if not 1 <= len(cu) <= MAX_SEQUENCES:
            raise ValueError(f"{name} has {len(cu)} entries; the documented range is 1..{MAX_SEQUENCES}")
        body, tail = _strip_tail(list(cu))
        if any(y < x for x, y in zip(body, body[1:])) or body[0] < 0:
            raise ValueError(f"{name} must be non-decreasing cumulative lengths (then 0s for trailing "
                             f"batches that take no part), got {list(cu)}")
        if body[-1] > total or (not tail and body[-1] != total):
            raise ValueError(f"{name} ends at {body[-1]}, the tensor has T = {total} "
                             "(fewer tokens only with trailing 0s)")
        ends.append(body)
        tails.append(tail)
    if len(actual_seq_qlen) != len(actual_seq_kvlen) or tails[0] != tails[1]:
        raise ValueError("actual_seq_qlen and actual_seq_kvlen need one entry per batch each, "
                         "with the same trailing 0s")
    qs, ks = [0] + ends[0], [0] + ends[1]
    return [(qs[i], qs[i + 1], ks[i], ks[i + 1]) for i in range(len(ends[0]))]


def write_stat(per_seq, seqs, t: int, n: int, softmax_layout: str, device) -> torch.Tensor:
    """Per-sequence [n, sq_i] stats -> the [T, N, 8] output in the documented storage
    (rows of tokens in no sequence: 0)."""
    if softmax_layout == "TND":
        out = torch.zeros(t, n, device=device)
        for (qa, qb, _, _), x in zip(seqs, per_seq):
            out[qa:qb] = x.t()
        return out.unsqueeze(-1).expand(t, n, 8).contiguous()
    flat = torch.zeros(t * n, device=device)
    for (qa, qb, _, _), x in zip(seqs, per_seq):
        flat[qa * n:qb * n] = x.reshape(-1)
    return flat.unsqueeze(-1).expand(t * n, 8).contiguous().view(t, n, 8)


def read_stat(stat, seqs, n: int, softmax_layout: str):
    """The inverse of `write_stat`: per sequence [n, sq_i]."""
    col = stat[..., 0]
    if softmax_layout == "TND":
        return [col[qa:qb].t() for qa, qb, _, _ in seqs]
    flat = col.reshape(-1)
    return [flat[qa * n:qb * n].view(n, qb - qa) for qa, qb, _, _ in seqs]
