"""Which layers' groups swap: measured on the run's first passes, decided once (--swap-attention-mode).

A pass is one micro-batch's forward through this rank's layers (a run of groups whose layer
numbers rise) and its backward. The first SKIP passes warm up (allocations, kernel choices), the
next MEASURE passes are timed (every group swaps meanwhile, so the warm-up holds the whole
saving's memory): per group its bytes, the compute from its forward start to the next group's,
and from the start of its backward (after any wait for its fetch) to the next lower group's.
Then npuspeed/offload/sizing.py decides, from those figures and the measured host link, which
groups swap from then on (`hidden`: those whose copies hide with a margin; `whole`: all, with
the cost stated), one log line says so, and the compute stream's waits in the next pass are
measured against the estimate (npuspeed report, summary's `swap_sizing`).

Where the link cannot overlap compute (an in-order backend: the CPU, where the host is the
device), `hidden` knows its answer before any pass: no copy can hide, so no group swaps and no
pass is timed. Timing there would swap every group for three passes and hold each saved tensor
twice in the one memory (measured: a 60 MiB run peaked at 153 MiB), for a decision known in
advance (the link is not measured either: on the CPU that alone holds two 64 MiB buffers); the
decision is still recorded once the first pass has named the groups.
`whole` runs the copies on any backend (the mechanics, tested on the CPU).
"""
from __future__ import annotations

from npuspeed import telemetry
from npuspeed.accelerator import host_link
from npuspeed.offload import decisions, sizing
from npuspeed.offload.marks import Marks

SKIP, MEASURE = 1, 2
FEATURE = "--swap-attention"
#: counters: decided, units_moved, units_kept, bytes_moved (per pass), exposed_us_estimated,
#: exposed_us_measured (per pass, after the decision)
PREFIX = "swap.sizing."


class Record:
    """What the sizer keeps of one group (never the group: it holds host and device buffers)."""

    __slots__ = ("name", "pass_index", "index", "out_bytes")

    def __init__(self, name: str, pass_index: int, index: int):
        self.name, self.pass_index, self.index, self.out_bytes = name, pass_index, index, 0


class LayerSizer:
    def __init__(self, acc, mode: str, link, note=None):
        self.acc, self.mode, self._link, self.note = acc, mode, link, note or (lambda _m: None)
        self.marks = Marks(acc)
        self.passes: list[list] = []  # Records of each pass, in forward order (old ones emptied)
        self.moved: set[str] | None = None  # None: not decided, every group swaps
        self.decisions: list = []
        self.check: list | None = None  # the passes timed after the decision
        self.in_order = False  # decided before any pass: nothing can hide on this backend (docstring)

    # -- the manager's questions ----------------------------------------------------------------
    def new_group(self, name: str, starts_pass: bool) -> tuple[Record, bool]:
        """A Record for a new group called `name`, and whether the group swaps."""
        if not self.passes and self.moved is None and self.mode == "hidden" and not host_link.overlaps(self.acc):
            self.in_order, self.moved, self.check = True, set(), []
        if starts_pass or not self.passes:
            self._pass_ends()
            self.passes.append([])
        rec = Record(name, len(self.passes) - 1, len(self.passes[-1]))
        self.passes[-1].append(rec)
        if self.timed(rec):
            self.marks.mark(("f", rec.pass_index, rec.index))
        return rec, self.moved is None or name in self.moved

    def timed(self, rec) -> bool:
        index = rec.pass_index
        return (self.moved is None and SKIP <= index < SKIP + MEASURE) or \
            (bool(self.check) and index in self.check)

    def mark(self, rec, what: str) -> None:
        if self.timed(rec):
            self.marks.mark((what, rec.pass_index, rec.index))

    # -- deciding -------------------------------------------------------------------------------
    def _complete(self, index: int) -> bool:
        return all(self.marks.has(("post", index, i)) for i in range(len(self.passes[index])))

    def _pass_ends(self) -> None:
        if self.in_order and self.passes and not self.decisions:
            self._decide_in_order([g.name for g in self.passes[-1]])
        if self.moved is None:
            measured = [i for i in range(SKIP, min(len(self.passes), SKIP + MEASURE)) if self._complete(i)]
            if len(measured) == MEASURE:
                self._decide(measured)
        elif self.check and all(i < len(self.passes) and self._complete(i) for i in self.check):
            self._checked()
        elif not self.check and len(self.passes) > 1:
            self.passes[-2] = []

    def _units(self, points: dict, indices: list[int]) -> dict:
        """Per pass signature (the groups' names in order): their LayerUnits, averaged."""
        by_sig: dict[tuple, list] = {}
        for p in indices:
            groups = self.passes[p]
            sig = tuple(g.name for g in groups)
            rows = []
            for i, g in enumerate(groups):
                f = points[("f", p, i)]
                fwd = (points[("f", p, i + 1)] if i + 1 < len(groups) else points[("pre", p, i)]) - f
                bwd = points[("pre", p, i - 1)] - points[("post", p, i)] if i > 0 else 0.0
                rows.append((g.out_bytes, max(fwd, 0.0), max(bwd, 0.0)))
            by_sig.setdefault(sig, []).append(rows)
        out = {}
        for sig, samples in by_sig.items():
            out[sig] = [sizing.LayerUnit(name, max(r[i][0] for r in samples),
                                         sum(r[i][1] for r in samples) / len(samples),
                                         sum(r[i][2] for r in samples) / len(samples))
                        for i, name in enumerate(sig)]
        return out

    def _decide(self, indices: list[int]) -> None:
        link = self._link()
        points = self.marks.read()
        moved: set[str] = set()
        for sig, units in self._units(points, indices).items():
            d = sizing.size_layers(FEATURE, self.mode, units, link)
            self.decisions.append(d)
            decisions.record(d)
            moved |= set(d.moved)
            telemetry.count(PREFIX + "units_moved", len(d.moved))
            telemetry.count(PREFIX + "units_kept", len(d.kept))
            telemetry.count(PREFIX + "bytes_moved", d.bytes_moved)
            telemetry.count(PREFIX + "exposed_us_estimated", int(d.exposed_s * 1e6))
            self.note(f"{d.line()}; {link.line()}")
        telemetry.count(PREFIX + "decided")
        self.moved = moved
        self.marks = Marks(self.acc)
        self.check = [len(self.passes)]  # the pass about to start: the first timed after the decision
        self._forget()

    def _decide_in_order(self, names: list[str]) -> None:
        """The in-order backend's decision, recorded with the groups of the first pass: none moves."""
        link = host_link.unmeasured(self.acc)  # nothing to price: measuring would only cost memory
        d = sizing.Decision(feature=FEATURE, mode=self.mode, units=len(names), moved=[],
                            kept={name: sizing.IN_ORDER for name in names}, bytes_moved=0, bytes_total=0,
                            transfer_s=0.0, exposed_s=0.0, compute_s=0.0, link=link.as_dict())
        self.decisions.append(d)
        decisions.record(d)
        telemetry.count(PREFIX + "units_kept", len(d.kept))
        telemetry.count(PREFIX + "decided")
        self.note(f"{d.line()} (decided without timing the passes or measuring the link: copies cannot overlap "
                  "compute on this backend)")

    def _checked(self) -> None:
        points = self.marks.read()
        waits = [points[("post", p, i)] - points[("pre", p, i)] for p in self.check for i in range(len(self.passes[p]))]
        exposed = sum(waits) / len(self.check)
        for d in self.decisions:
            decisions.checked(d, exposed / len(self.decisions), len(self.check))
        telemetry.count(PREFIX + "exposed_us_measured", int(exposed * 1e6))
        self.note(f"{FEATURE} sizing checked: the compute stream waited {exposed * 1e3:.2f} ms a micro-batch for "
                  f"swap copies after the decision (estimated {sum(d.exposed_s for d in self.decisions) * 1e3:.2f})")
        self.check = []
        self.marks = Marks(self.acc)
        self._forget()

    def _forget(self) -> None:
        for p in range(len(self.passes) - 1):  # nothing reads old passes again
            self.passes[p] = []
