"""Paired or serial, measured on the run's own steps: the flag never makes a step slower.

Whether pairing a forward with a backward pays depends on how much of the step the all-to-alls
take and what the turn changes cost (on a tiny model the hand-overs cost more than the transfers
they hide). No single op can be timed for this, so the run's own steps are: the first schedule
call pairs (its time includes every lazy set-up and is not counted), then serial and paired calls
alternate, `ROUNDS` of each, and every rank takes the faster by the sum over all ranks (one
all-reduce on the world group: paired and serial issue collectives in different orders, so all
ranks must run the same). Both give the same numbers to the bit; only time differs.
`NPUSPEED_FB_OVERLAP_PATH=paired|serial` forces one. The decision is a record in `npuspeed
report`'s path_choices (chooser "moe_fb_overlap"), and said once in the log.
"""
from __future__ import annotations

import time

from npuspeed.ops.choose.chooser import Chooser
from npuspeed.ops.choose.record import MEGATRON, Choice

FORCE_ENV = "NPUSPEED_FB_OVERLAP_PATH"
PAIRED, SERIAL = "paired", "serial"
ROUNDS = 2
_CHOOSER: Chooser | None = None


def chooser() -> Chooser:
    global _CHOOSER
    if _CHOOSER is None:
        _CHOOSER = Chooser(name="moe_fb_overlap", force_env=FORCE_ENV, forceable=(PAIRED, SERIAL),
                           baseline=MEGATRON)
    return _CHOOSER


class StepTrial:
    """Per number of micro-batches: the calls seen, their times, the decision."""

    def __init__(self, microbatches: int):
        self.key = (microbatches,)
        self.calls = 0
        self.times: dict[str, list[float]] = {PAIRED: [], SERIAL: []}

    def mode(self) -> str:
        forced = chooser().forced()  # the variable, checked as every chooser checks its own
        if forced is not None:
            self._record(Choice("fb_overlap", self._label(), PAIRED if forced == PAIRED else MEGATRON,
                                f"forced by {FORCE_ENV}={forced}"))
            return forced
        done = chooser().choices.get(self.key)
        if done is not None:
            return PAIRED if done.impl == PAIRED else SERIAL
        return PAIRED if self.calls % 2 == 0 else SERIAL  # 0: set-up (paired, not timed), 1: serial, 2: paired, ...

    def timed(self, mode: str, run, sync, agree, note):
        """run() under `mode`; counts its time while undecided; decides after ROUNDS of each."""
        undecided = self.key not in chooser().choices
        sync()
        t0 = time.perf_counter()
        out = run()
        sync()
        elapsed = time.perf_counter() - t0
        if undecided and self.calls > 0:
            self.times[mode].append(elapsed)
        self.calls += 1
        if undecided and min(len(v) for v in self.times.values()) >= ROUNDS:
            paired, serial = agree([min(self.times[PAIRED]), min(self.times[SERIAL])])
            impl = PAIRED if paired < serial else MEGATRON
            ms = {PAIRED: paired * 1e3, MEGATRON: serial * 1e3}
            why = (f"measured: paired {paired * 1e3:.1f} ms, serial {serial * 1e3:.1f} ms a step "
                   f"(fastest of {ROUNDS}, summed over ranks)")
            self._record(Choice("fb_overlap", self._label(), impl, why, ms=ms))
            if impl == MEGATRON:
                note(f"--moe-fb-overlap: Megatron's serial schedule runs for {self._label()}, measured faster "
                     f"than pairing there ({why.split(': ', 1)[1]}); `npuspeed report` has the record")
        return out

    def _label(self) -> str:
        return f"{self.key[0]} micro-batches"

    def _record(self, choice: Choice) -> None:
        chooser().choices.setdefault(self.key, choice)
