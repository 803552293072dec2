"""The order in which a pipeline rank runs forwards and backwards (Megatron-Core 0.16).

- no pipelining: forward, backward, one micro-batch at a time;
- 1F1B: stage r runs min(PP - r - 1, M) warm-up forwards, then one forward one backward,
  then the cool-down backwards: it holds at most min(PP - r, M) micro-batches;
- interleaved (VPP chunks): (PP - r - 1) x 2 + (chunks - 1) x PP warm-up forwards over the
  schedule table (groups of PP micro-batches, chunk by chunk; backwards walk the chunks in
  reverse), capped at M x chunks.
`events` lists ("F"|"B", chunk) for one rank and one step; memory.py stacks the replayed
micro-batches along it.
"""
from __future__ import annotations


def _table(num_microbatches: int, chunks: int, group: int) -> list[tuple[int, int]]:
    table = []
    for start in range(0, num_microbatches, group):
        end = min(start + group, num_microbatches)
        for chunk in range(chunks):
            table += [(mb, chunk) for mb in range(start, end)]
    return table


def events(pp: int, rank: int, chunks: int, num_microbatches: int) -> list[tuple[str, int]]:
    m = num_microbatches
    if pp == 1:
        return [ev for _ in range(m) for ev in (("F", 0), ("B", 0))]
    if chunks == 1:
        warm = min(pp - rank - 1, m)
        out = [("F", 0)] * warm
        for _ in range(m - warm):
            out += [("F", 0), ("B", 0)]
        return out + [("B", 0)] * warm
    total = m * chunks
    warm = min((pp - rank - 1) * 2 + (chunks - 1) * pp, total)
    table = _table(m, chunks, pp)
    fwd = [("F", c) for _, c in table]
    bwd = [("B", chunks - 1 - c) for _, c in table]
    out = fwd[:warm]
    for k in range(total - warm):
        out += [fwd[warm + k], bwd[k]]
    return out + bwd[total - warm:]


def max_in_flight(pp: int, rank: int, chunks: int, num_microbatches: int) -> int:
    """Largest number of (micro-batch, chunk) forwards held at once."""
    held = best = 0
    for kind, _ in events(pp, rank, chunks, num_microbatches):
        held += 1 if kind == "F" else -1
        best = max(best, held)
    return best
