"""How much of each expert all-to-all the compute did not wait for, measured per phase.

Per all-to-all: launched at `launch`, done when its work's future completes (gloo completes it
on its own thread; where no callback came before the wait ended, the wait's end), and the time
the compute thread spent in `wait`. Hidden = in flight - waited. Summed per phase of the step
(warm_up: a forward with no backward beside it; steady: a forward and a backward together;
cool_down: a backward alone; "layer": the chunked overlap inside one layer; "serial": a step run
without overlap, kept apart from the overall share: what the all-to-alls cost unhidden). This needs no fast
interconnect: on CPU with gloo it measures what the schedule hid of the transfers it really made.
"""
from __future__ import annotations

import contextlib
import threading
import time

PHASES = ("warm_up", "steady", "cool_down", "layer")
SERIAL = "serial"
_lock = threading.Lock()
_totals: dict[str, list[float]] = {}  # phase -> [in flight s, waited s, count]
_phase = {"name": "layer"}  # the step's phase, set by the schedule (both of a pair's threads share it)


class Flight:
    """One all-to-all on the clock: `launch` when it starts, `wait` to block on it."""

    __slots__ = ("phase", "start", "done")

    def __init__(self, work):
        self.phase = _phase["name"]
        self.start = time.perf_counter()
        self.done = None
        try:
            work.get_future().add_done_callback(self._finished)
        except (RuntimeError, AttributeError):  # a backend without futures: the wait's end counts
            pass

    def _finished(self, _future) -> None:
        if self.done is None:
            self.done = time.perf_counter()

    def wait(self, work) -> None:
        t0 = time.perf_counter()
        work.wait()
        t1 = time.perf_counter()
        done = self.done if self.done is not None and self.done <= t1 else t1
        with _lock:
            row = _totals.setdefault(self.phase, [0.0, 0.0, 0])
            row[0] += max(done - self.start, 0.0)
            row[1] += min(t1 - t0, max(done - self.start, 0.0))
            row[2] += 1


def launch(work) -> Flight:
    return Flight(work)


@contextlib.contextmanager
def phase(name: str):
    """All-to-alls launched inside the block (by any thread) count towards `name`."""
    old = _phase["name"]
    _phase["name"] = name
    try:
        yield
    finally:
        _phase["name"] = old


def reset() -> None:
    with _lock:
        _totals.clear()


def summary() -> dict | None:
    """{phase: hidden fraction, ..., "overall": ..., "in_flight_ms", "waited_ms", "count",
    "per_phase": {phase: {in_flight_ms, waited_ms, count}}}; None when nothing was measured."""
    with _lock:
        rows = {k: list(v) for k, v in _totals.items()}
    if not rows:
        return None
    hidden_rows = [r for name, r in rows.items() if name != SERIAL]
    flight = sum(r[0] for r in hidden_rows)
    waited = sum(r[1] for r in hidden_rows)
    out = {name: (1.0 - r[1] / r[0]) if r[0] > 0 else None for name, r in rows.items()}
    out.update(overall=(1.0 - waited / flight) if flight > 0 else None, in_flight_ms=flight * 1e3,
               waited_ms=waited * 1e3, count=int(sum(r[2] for r in hidden_rows)),
               per_phase={name: {"in_flight_ms": r[0] * 1e3, "waited_ms": r[1] * 1e3, "count": int(r[2])}
                          for name, r in rows.items()})
    return out


def line(data: dict | None = None) -> str | None:
    """One log line: the hidden share overall and per phase."""
    data = data if data is not None else summary()
    if not data or data.get("overall") is None:
        return None
    parts = [f"{name} {data[name]:.2f}" for name in PHASES if data.get(name) is not None]
    return (f"expert all-to-all hidden: {data['overall']:.2f} of {data['in_flight_ms']:.1f} ms in flight "
            f"({', '.join(parts)}; {data['count']} transfers)")
