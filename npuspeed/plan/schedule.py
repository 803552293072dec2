"""The order in which a pipeline rank runs forwards and backwards (Megatron-Core 0.16, and
DualPipeV's under `--schedules-method dualpipev`).

- no pipelining: forward, backward, one micro-batch at a time;
- 1F1B: stage r runs min(PP - r - 1, M) warm-up forwards, then one forward one backward,
  then the cool-down backwards: it holds at most min(PP - r, M) micro-batches;
- interleaved (VPP chunks): (PP - r - 1) x 2 + (chunks - 1) x PP warm-up forwards over the
  schedule table (groups of PP micro-batches, chunk by chunk; backwards walk the chunks in
  reverse), capped at M x chunks;
- DualPipeV (schedule "dualpipev", two chunks in a V: placement.py): each rank runs the order of
  npuspeed/features/pipeline/v_order.py, the one the training run executes; a paired step waits
  for both its inputs and takes its forward's and its backward's time (run.py runs them back
  to back, or taking turns under --moe-fb-overlap, whose hidden all-to-alls fb_overlap.py prices).
`events` lists ("F"|"B", chunk) for one rank and one step; memory.py stacks the replayed
micro-batches along it; `simulate` times a step from them.
"""
from __future__ import annotations

from npuspeed.features.pipeline import v_order

V = "dualpipev"


def _table(num_microbatches: int, chunks: int, group: int) -> list[tuple[int, int]]:
    table = []
    for start in range(0, num_microbatches, group):
        end = min(start + group, num_microbatches)
        for chunk in range(chunks):
            table += [(mb, chunk) for mb in range(start, end)]
    return table


def _v_steps(pp: int, rank: int, num_microbatches: int) -> list[tuple]:
    """DualPipeV's order of one rank as steps of ("F"|"B", micro-batch, chunk): one item, or a
    paired step's forward and backward."""
    out = []
    for _phase, op in v_order.schedule(pp, rank, num_microbatches):
        step = ()
        if op.forward is not None:
            step += (("F", op.f_micro, op.forward),)
        if op.backward is not None:
            step += (("B", op.b_micro, op.backward),)
        out.append(step)
    return out


def events(pp: int, rank: int, chunks: int, num_microbatches: int, schedule: str | None = None,
           taking_turns: bool = False) -> list[tuple[str, int]]:
    """("F"|"B", chunk) of one rank's step in order (`schedule`: None for Megatron's, or V). A V
    paired step runs its backward, then its forward (run.py), unless its halves take turns
    (`taking_turns`, --moe-fb-overlap): then both are alive at once, forward first here."""
    if schedule == V:
        return [(kind, c) for step in _v_steps(pp, rank, num_microbatches)
                for kind, _, c in (step if taking_turns else sorted(step, key=lambda e: e[0] != "B"))]
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


def max_in_flight(pp: int, rank: int, chunks: int, num_microbatches: int, schedule: str | None = None,
                  taking_turns: bool = False) -> int:
    """Largest number of (micro-batch, chunk) forwards held at once."""
    held = best = 0
    for kind, _ in events(pp, rank, chunks, num_microbatches, schedule, taking_turns):
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


def _megatron_input(pp: int, chunks: int):
    """The op whose output an op of Megatron's order waits for, and whether it crosses ranks."""
    def dep(kind, r, mb, c):
        if kind == "F":
            if r > 0:
                return ("F", r - 1, mb, c), True
            return (("F", pp - 1, mb, c - 1), True) if c > 0 else (None, False)
        if r < pp - 1:
            return ("B", r + 1, mb, c), True
        if c < chunks - 1:
            return ("B", 0, mb, c + 1), True
        return ("F", r, mb, c), False  # the loss: this chunk's own forward
    return dep


def _v_input(pp: int):
    """The same in DualPipeV's V: chunk 0 runs down the ranks, chunk 1 back up; rank P-1 hands
    chunk 0's output to its own chunk 1 and rank 0's chunk 1 computes the loss (no hop)."""
    def dep(kind, r, mb, c):
        if kind == "F":
            if c == 0:
                return (("F", r - 1, mb, 0), True) if r > 0 else (None, False)
            return (("F", r + 1, mb, 1), True) if r < pp - 1 else (("F", r, mb, 0), False)
        if c == 1:
            return (("B", r - 1, mb, 1), True) if r > 0 else (("F", 0, mb, 1), False)
        return (("B", r + 1, mb, 0), True) if r < pp - 1 else (("B", r, mb, 1), False)
    return dep


def simulate(pp: int, chunks: int, num_microbatches: int, fwd, bwd, hop: float = 0.0,
             schedule: str | None = None) -> float:
    """Seconds from the first forward to the last backward of a step: each rank runs its ops in
    its schedule's order (Megatron's, or DualPipeV's with `schedule` "dualpipev"), an op starts
    when its rank is free and its input has arrived (`hop` seconds after the producing op on the
    neighbouring rank ended; none within a rank). fwd[r][c], bwd[r][c]: one micro-batch's
    forward/backward of chunk c on pipeline rank r."""
    return timeline(pp, chunks, num_microbatches, fwd, bwd, hop, schedule)[0]


def timeline(pp: int, chunks: int, num_microbatches: int, fwd, bwd, hop: float = 0.0,
             schedule: str | None = None) -> tuple[float, dict]:
    """`simulate`'s step and when each op's output was ready: {("F"|"B", rank, micro-batch,
    chunk): seconds}. A DualPipeV paired step runs as the training run runs it
    (features/dualpipev/run.py): both inputs received first, forward and backward back to back
    (F + B on the rank's clock), both outputs sent at its end."""
    if schedule == V:
        orders = [_v_steps(pp, r, num_microbatches) for r in range(pp)]
        dep_of = _v_input(pp)
    else:
        orders = [[(op,) for op in _order(pp, r, chunks, num_microbatches)] for r in range(pp)]
        dep_of = _megatron_input(pp, chunks)
    done: dict[tuple, float] = {}
    free = [0.0] * pp
    pos = [0] * pp

    def ready(kind, r, mb, c):
        dep, crosses = dep_of(kind, r, mb, c)
        if dep is None:
            return 0.0
        t = done.get(dep)
        return None if t is None else t + (hop if crosses and pp > 1 else 0.0)

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                step = orders[r][pos[r]]
                inputs = [ready(kind, r, mb, c) for kind, mb, c in step]
                if None in inputs:
                    break
                free[r] = max(free[r], *inputs) + sum((fwd if kind == "F" else bwd)[r][c] for kind, _, c in step)
                for kind, mb, c in step:
                    done[(kind, r, mb, c)] = free[r]
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked (a bug in schedule order)")
    return max(free), done
