"""DualPipeV's per-rank order (npuspeed/features/pipeline/v_order.py): every forward and
backward of every chunk and micro-batch once, in micro-batch order per chunk, dependencies
satisfiable across ranks (a replay with unit costs never deadlocks), the paired steps' count,
and the V placement's stage numbers."""
from __future__ import annotations

import pytest

from npuspeed.features.pipeline import v_order as order
from npuspeed.features.pipeline.v_placement import stage_of


def _replay(ranks: int, m: int) -> float:
    """Run every rank's order with unit-cost ops; an op waits for its inputs. Returns the makespan."""
    orders = [order.schedule(ranks, r, m) for r in range(ranks)]
    done, free, pos = {}, [0.0] * ranks, [0] * ranks

    def dep(kind, r, chunk, mb):
        if kind == "F":
            if chunk == 0:
                return None if r == 0 else ("F", r - 1, 0, mb)
            return ("F", r + 1, 1, mb) if r < ranks - 1 else ("F", r, 0, mb)
        if chunk == 1:
            return ("F", 0, 1, mb) if r == 0 else ("B", r - 1, 1, mb)
        return ("B", r, 1, mb) if r == ranks - 1 else ("B", r + 1, 0, mb)

    left = sum(map(len, orders))
    while left:
        moved = False
        for r in range(ranks):
            while pos[r] < len(orders[r]):
                _, op = orders[r][pos[r]]
                parts = ([("F", r, op.forward, op.f_micro)] if op.forward is not None else []) + \
                        ([("B", r, op.backward, op.b_micro)] if op.backward is not None else [])
                deps = [dep(*p) for p in parts]
                if any(d is not None and d not in done for d in deps):
                    break
                free[r] = max([free[r]] + [done[d] for d in deps if d is not None]) + len(parts)
                for p in parts:
                    done[p] = free[r]
                pos[r] += 1
                left -= 1
                moved = True
        assert moved, f"deadlock at P={ranks}, m={m}: positions {pos}"
    return max(free)


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_every_op_once_in_order_and_no_deadlock(ranks, extra):
    m = 2 * ranks + extra
    for r in range(ranks):
        ops = order.schedule(ranks, r, m)
        for kind, attr in (("forward", "f_micro"), ("backward", "b_micro")):
            for chunk in (0, 1):
                seen = [getattr(op, attr) for _, op in ops if getattr(op, kind) == chunk]
                assert seen == list(range(m)), (r, kind, chunk, seen)
        paired = sum(op.paired for _, op in ops)
        assert paired == 2 * (m - 2 * ranks + r + 1) + (ranks - r - 1)
        assert all(op.forward != op.backward or not op.paired for _, op in ops)
    assert _replay(ranks, m) > 0


def test_too_few_microbatches_and_ranks_are_refused():
    with pytest.raises(ValueError, match="at least 2 x 2 micro-batches"):
        order.schedule(2, 0, 3)
    with pytest.raises(ValueError, match="2\\+ pipeline ranks"):
        order.schedule(1, 0, 4)


def test_a_dependency_broken_order_is_caught():
    """The replay catches an order whose backward comes before its forward (shown once)."""
    real = order.schedule
    try:
        order.schedule = lambda p, r, m: list(reversed(real(p, r, m)))
        with pytest.raises(AssertionError, match="deadlock"):
            _replay(2, 4)
    finally:
        order.schedule = real


def test_v_placement_stages():
    # P = 4: rank 0 holds stages 0 and 7 (first and last), rank 3 stages 3 and 4 (the V's turn)
    assert [(stage_of(r, 4, 0), stage_of(r, 4, 1)) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
