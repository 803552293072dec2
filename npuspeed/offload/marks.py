"""Points on the compute stream, timed by the device's own events and read after one
synchronize: how the swaps measure the compute their copies overlap, and how long the compute
stream waited for a copy. On an in-order backend the events read the host clock (base.NullEvent),
which is the compute's own time there."""
from __future__ import annotations


class Marks:
    def __init__(self, acc):
        self.acc = acc
        self.points: dict = {}
        self.first = None

    def mark(self, key) -> None:
        event = self.acc.Event(enable_timing=True)
        event.record(self.acc.current_stream())
        if self.first is None:
            self.first = event
        self.points[key] = event

    def has(self, key) -> bool:
        return key in self.points

    def read(self) -> dict:
        """Seconds of every point after the first (one synchronize: call it once, at a decision)."""
        if self.first is None:
            return {}
        self.acc.synchronize()
        return {k: self.first.elapsed_time(e) / 1e3 for k, e in self.points.items()}
