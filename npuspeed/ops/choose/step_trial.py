"""A feature's path or Megatron's, chosen by timing the run's own training steps.

For the features whose gain no single op shows (an overlap hides transfers behind other work of
the same step, and what its hand-overs cost depends on the whole step): the first call runs the
feature's path untimed (its time holds every lazy set-up), then Megatron's path and the
feature's alternate, `ROUNDS` of each, and every rank takes the faster by the sum over all ranks
(`agree`: the two paths issue different collectives, so all ranks must run the same one). The
decision is a record of the feature's chooser (`npuspeed report`'s path_choices) and, where
Megatron's path wins, one line in the log. The chooser's forcing variable picks one without a
trial; `untimed` (e.g. --deterministic-mode) keeps the feature's path without one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from npuspeed.ops.choose.chooser import Chooser
from npuspeed.ops.choose.record import MEGATRON, Choice

ROUNDS = 2
_CHOOSERS: dict[str, Chooser] = {}  # one per feature, made on first use


def chooser(name: str, force_env: str, forceable: tuple) -> Chooser:
    """The feature's chooser (its records are `npuspeed report`'s path_choices under `name`)."""
    made = _CHOOSERS.get(name)
    if made is None:
        made = _CHOOSERS[name] = Chooser(name=name, force_env=force_env, forceable=forceable, baseline=MEGATRON)
    return made


@dataclass(frozen=True)
class Paths:
    """The two paths' names and how the log names them."""

    on: str  # the feature's path: its mode name and the record's impl when it wins
    off: str  # the mode name of Megatron's path (its record's impl is MEGATRON)
    flag: str  # e.g. "--moe-fb-overlap"
    off_text: str  # e.g. "Megatron's serial schedule"
    on_text: str  # e.g. "pairing"


class StepTrial:
    """Per key (e.g. the number of micro-batches): the calls seen, their times, the decision."""

    def __init__(self, chooser: Chooser, op: str, paths: Paths, key: tuple, label: str, untimed: str = ""):
        self.chooser, self.op, self.paths, self.key, self.label = chooser, op, paths, key, label
        self.untimed = untimed
        self.calls = 0
        self.times: dict[str, list[float]] = {paths.on: [], paths.off: []}

    def mode(self) -> str:
        """The path this call takes: forced, decided, or the trial's turn (0: set-up on the
        feature's path, not timed; then Megatron's, the feature's, ...)."""
        on, off = self.paths.on, self.paths.off
        forced = self.chooser.forced()  # the variable, checked as every chooser checks its own
        if forced is not None:
            self._record(Choice(self.op, self.label, on if forced == on else MEGATRON, f"forced by "
                                f"{self.chooser.force_env}={forced}"))
            return forced
        if self.untimed:
            self._record(Choice(self.op, self.label, on, self.untimed))
        done = self.chooser.choices.get(self.key)
        if done is not None:
            return on if done.impl == on else off
        return on if self.calls % 2 == 0 else off

    def timed(self, mode: str, run, sync, agree, note):
        """run() under `mode`; counts its time while undecided; decides after ROUNDS of each."""
        undecided = self.key not in self.chooser.choices
        sync()
        t0 = time.perf_counter()
        out = run()
        sync()
        elapsed = time.perf_counter() - t0
        if undecided and self.calls > 0:
            self.times[mode].append(elapsed)
        self.calls += 1
        if undecided and min(len(v) for v in self.times.values()) >= ROUNDS:
            self._decide(agree, note)
        return out

    def _decide(self, agree, note) -> None:
        p = self.paths
        mine, theirs = agree([min(self.times[p.on]), min(self.times[p.off])])
        impl = p.on if mine < theirs else MEGATRON
        why = (f"measured: {p.on} {mine * 1e3:.1f} ms, {p.off} {theirs * 1e3:.1f} ms a step "
               f"(fastest of {ROUNDS}, summed over ranks)")
        self._record(Choice(self.op, self.label, impl, why, ms={p.on: mine * 1e3, MEGATRON: theirs * 1e3}))
        if impl == MEGATRON:
            note(f"{p.flag}: {p.off_text} runs for {self.label}, measured faster than {p.on_text} there "
                 f"({why.split(': ', 1)[1]}); `npuspeed report` has the record")

    def _record(self, choice: Choice) -> None:
        self.chooser.choices.setdefault(self.key, choice)


def world_sum(acc):
    """agree() for StepTrial.timed: each timing summed over every rank."""

    def agree(values):
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=acc.device())
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(t)
        return t.tolist()

    return agree
