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


def _order(pp: int, rank: int, chunks: int, num_microbatches: int) -> list[tuple[str, int, int]]:
    """`events` with micro-batch numbers: ("F"|"B", micro-batch, chunk)."""
    if chunks == 1:
        table = [(mb, 0) for mb in range(num_microbatches)]
    else:
        table = _table(num_microbatches, chunks, pp)
    nf = nb = 0
    out = []
    for kind, _ in events(pp, rank, chunks, num_microbatches):
        if kind == "F":
            mb, c = table[nf]
            nf += 1
        else:
            mb, c = table[nb]
            c = chunks - 1 - c
            nb += 1
        out.append((kind, mb, c))
    return out


def simulate(pp: int, chunks: int, num_microbatches: int, fwd, bwd, hop: float = 0.0) -> float:
    """Seconds from the first forward to the last backward of a step: each rank runs its ops in
    Megatron's order, an op starts when its rank is free and its input has arrived (`hop`
    seconds after the producing op on the neighbouring stage ended). fwd[r][c], bwd[r][c]: one
    micro-batch's forward/backward of chunk c on pipeline rank r."""
    orders = [_order(pp, r, chunks, num_microbatches) for r in range(pp)]
    done: dict[tuple, float] = {}
    free = [0.0] * pp
    pos = [0] * pp
    last_rank, last_chunk = pp - 1, chunks - 1

    def ready(kind, r, mb, c):
        if kind == "F":
            if r > 0:
                dep = ("F", r - 1, mb, c)
            elif c > 0:
                dep = ("F", last_rank, mb, c - 1)
            else:
                return 0.0
        else:
            if r < last_rank:
                dep = ("B", r + 1, mb, c)
            elif c < last_chunk:
                dep = ("B", 0, mb, c + 1)
            else:
                return done.get(("F", r, mb, c))
        t = done.get(dep)
        return None if t is None else t + (hop if pp > 1 else 0.0)

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, mb, c = orders[r][pos[r]]
                t = ready(kind, r, mb, c)
                if t is None:
                    break
                start = max(free[r], t)
                free[r] = start + (fwd if kind == "F" else bwd)[r][c]
                done[(kind, r, mb, c)] = free[r]
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked (a bug in schedule order)")
    return max(free)
