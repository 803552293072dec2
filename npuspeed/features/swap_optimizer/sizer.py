"""Which optimizer chunks go to the host: measured on the run's first steps, decided once
(--swap-optimizer-mode).

The first SKIP steps warm up (Adam creates its states, allocations), the next MEASURE steps
are timed with every chunk swapped (so the warm-up holds the whole saving's memory): per chunk
its bytes and its update's compute time (from the end of the wait for its copy in to the end of
its update and main-to-model copy), and the compute between two steps (the forward and
backward the copies out of a step's last chunks may run under). At the next step's start
npuspeed/offload/sizing.py decides from those figures and the measured host link which chunks
move from then on (`hidden`: those whose copies hide with a margin; the others stay resident on
the device; `whole`: all, with the cost stated), one log line says so, and the compute
stream's waits in the next step are measured against the estimate.
"""
from __future__ import annotations

from npuspeed import telemetry
from npuspeed.offload import decisions, sizing
from npuspeed.offload.marks import Marks

SKIP, MEASURE = 1, 1
FEATURE = "--swap-optimizer"
#: counters: decided, chunks_moved, chunks_resident, bytes_moved (per step),
#: exposed_us_estimated, exposed_us_measured (per step, after the decision)
PREFIX = "swap_optimizer.sizing."


class ChunkSizer:
    def __init__(self, acc, mode: str, link, note=None):
        self.acc, self.mode, self._link, self.note = acc, mode, link, note or (lambda _m: None)
        self.marks = Marks(acc)
        self.step = -1
        self.resident: set[int] | None = None  # None: not decided, every chunk moves
        self.decision = None
        self.sizes: dict[int, int] = {}
        self.checking = False

    def timed(self) -> bool:
        return (self.resident is None and SKIP <= self.step < SKIP + MEASURE) or self.checking

    def mark(self, what: str, k: int) -> None:
        if self.timed():
            self.marks.mark((what, self.step, k))

    def begin_step(self, chunk_bytes: list[int]) -> set[int] | None:
        """At a step's start: the chunks to keep resident from now on when this step decides
        (None otherwise)."""
        self.step += 1
        decided = None
        if self.resident is None and self.step == SKIP + MEASURE:
            self.marks.mark(("start", self.step, 0))
            decided = self._decide(chunk_bytes)
            self.checking = True
            return decided
        if self.checking and self.step == SKIP + MEASURE + 1:
            self._checked(len(chunk_bytes))
            self.checking = False
        if self.timed():
            self.marks.mark(("start", self.step, 0))
        return decided

    def end_step(self, n: int) -> None:
        if self.timed():
            self.marks.mark(("end", self.step, n))

    def _decide(self, chunk_bytes: list[int]) -> set[int]:
        link = self._link()
        p = self.marks.read()
        s = SKIP + MEASURE - 1  # the measured step
        n = len(chunk_bytes)
        chunks = [sizing.Chunk(f"chunk{k}", chunk_bytes[k], max(p[("done", s, k)] - p[("post", s, k)], 0.0))
                  for k in range(n)]
        gap = max(p[("start", s + 1, 0)] - p[("end", s, n)], 0.0)
        d = self.decision = sizing.size_chunks(FEATURE, self.mode, chunks, link, gap)
        decisions.record(d)
        moved = set(d.moved)
        resident = {k for k in range(n) if chunks[k].name not in moved}
        telemetry.count(PREFIX + "decided")
        telemetry.count(PREFIX + "chunks_moved", len(moved))
        telemetry.count(PREFIX + "chunks_resident", len(resident))
        telemetry.count(PREFIX + "bytes_moved", d.bytes_moved)
        telemetry.count(PREFIX + "exposed_us_estimated", int(d.exposed_s * 1e6))
        self.note(f"{d.line()}; {link.line()}")
        self.resident = resident
        self.marks = Marks(self.acc)
        return resident

    def _checked(self, n: int) -> None:
        p = self.marks.read()
        s = SKIP + MEASURE
        exposed = sum(p[("post", s, k)] - p[("pre", s, k)] for k in range(n) if ("pre", s, k) in p)
        decisions.checked(self.decision, exposed, 1)
        telemetry.count(PREFIX + "exposed_us_measured", int(exposed * 1e6))
        self.note(f"{FEATURE} sizing checked: the compute stream waited {exposed * 1e3:.2f} ms in a step for the "
                  f"swap's copies after the decision (estimated {self.decision.exposed_s * 1e3:.2f})")
        self.marks = Marks(self.acc)
