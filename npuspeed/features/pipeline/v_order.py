"""What one rank runs, in order, in a DualPipeV step: DualPipe cut in half along the pipeline.

P ranks hold 2P stages in a V: rank r holds stage r (chunk 0, the way down) and stage 2P-1-r
(chunk 1, the way back up), so rank 0 holds the first stage (embedding) and the last (loss), and
rank P-1 hands chunk 0's output to its own chunk 1. Per rank, with m >= 2P micro-batches:

1. 2(P-r-1) forwards of chunk 0 (warm-up, deepest for rank 0);
2. r+1 times: forward chunk 0, forward chunk 1;
3. P-r-1 times: backward chunk 1, forward chunk 1;
4. m-2P+r+1 times: forward chunk 0 beside backward chunk 1, then forward chunk 1 beside
   backward chunk 0 (the steady phase: every step a forward/backward pair of different
   micro-batches, which `--moe-fb-overlap` runs taking turns);
5. P-r-1 times: backward chunk 1, then forward chunk 1 beside backward chunk 0;
6. r+1 times: backward chunk 1, backward chunk 0;
7. P-r-1 backwards of chunk 0 (cool-down).

Each chunk's forwards, and its backwards, take the micro-batches in order; every forward and
backward of every micro-batch appears once. The bubble of this order, a paired step waiting for
both its inputs, is (P-1)(F&B + B - 3W) in chunk units (DeepSeek's DualPipe README), W = 0 here
(no dense weight-gradient split), against the interleaved schedule's (P-1)(F+B).
"""
from __future__ import annotations

from dataclasses import dataclass

F, B = "F", "B"


@dataclass(frozen=True)
class Op:
    """One schedule step: a forward (`forward` = chunk), a backward (`backward` = chunk), or
    both, paired (a forward and a backward of different micro-batches), with their micro-batches."""

    forward: int | None = None
    backward: int | None = None
    f_micro: int | None = None
    b_micro: int | None = None

    @property
    def paired(self) -> bool:
        return self.forward is not None and self.backward is not None


def phases(ranks: int, rank: int, microbatches: int) -> list[tuple[str, int, tuple]]:
    """[(phase name, repeats, the (kind, chunk) steps of one repeat)] for this rank."""
    p, r, m = ranks, rank, microbatches
    return [
        ("warm_up", 2 * (p - r - 1), ((F, 0),)),
        ("warm_up", r + 1, ((F, 0), (F, 1))),
        ("warm_up", p - r - 1, ((B, 1), (F, 1))),
        ("steady", m - 2 * p + r + 1, (((F, 0), (B, 1)), ((F, 1), (B, 0)))),
        ("cool_down", p - r - 1, ((B, 1), ((F, 1), (B, 0)))),
        ("cool_down", r + 1, ((B, 1), (B, 0))),
        ("cool_down", p - r - 1, ((B, 0),)),
    ]


def schedule(ranks: int, rank: int, microbatches: int) -> list[tuple[str, Op]]:
    """[(phase, Op)] for one step of this rank."""
    if ranks < 2 or not 0 <= rank < ranks:
        raise ValueError(f"DualPipeV needs 2+ pipeline ranks and a rank among them (got {rank} of {ranks})")
    if microbatches < 2 * ranks:
        raise ValueError(f"DualPipeV needs at least 2 x {ranks} micro-batches a step (got {microbatches})")
    nxt = {(F, 0): 0, (F, 1): 0, (B, 0): 0, (B, 1): 0}

    def take(key):
        nxt[key] += 1
        return nxt[key] - 1

    out = []
    for phase, repeats, steps in phases(ranks, rank, microbatches):
        for _ in range(repeats):
            for step in steps:
                pair = step if isinstance(step[0], tuple) else (step,)
                kw = {}
                for kind, chunk in pair:
                    if kind == F:
                        kw.update(forward=chunk, f_micro=take((F, chunk)))
                    else:
                        kw.update(backward=chunk, b_micro=take((B, chunk)))
                out.append((phase, Op(**kw)))
    return out
