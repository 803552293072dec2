"""The one measure-once-per-key rule every path-choosing feature uses (see the package doc)."""
from __future__ import annotations

import os
import weakref
from typing import Callable

import torch

from npuspeed.ops import _dispatch
from npuspeed.ops.choose import trial as trials
from npuspeed.ops.choose.criteria import Fastest
from npuspeed.ops.choose.record import MEGATRON, Choice

#: every chooser made in this process (npuspeed report lists their records)
_ALL: "weakref.WeakSet[Chooser]" = weakref.WeakSet()
DETERMINISTIC = "--deterministic-mode: not measured, so every rank and every run takes the same kernel"


class Chooser:
    """Per key: which candidate runs. `trial(name, run) -> seconds` can be injected (tests give
    fake timings); `criterion` ranks the survivors (criteria.py); `force_env` names the variable
    that forces a path (its values: `forceable`, plus `aliases`, e.g. "npuspeed" -> the flag's
    own kernels in order); `preference` orders the candidates where no timing decides (the
    baseline last); `check`: a candidate must agree with the baseline's output to run."""

    def __init__(self, repeats: int = 3, trial: Callable[[str, Callable], float] | None = None,
                 sync: Callable[[], None] | None = None, guard: Callable | None = None, budget_s: float = 0.2,
                 *, criterion=None, force_env: str | None = None, forceable=(), aliases=None, preference=(),
                 check: bool = True, baseline: str = MEGATRON, name: str = "", adaptive: bool = True):
        #: adaptive: more rounds (up to 4x) while cheap, none past the warm-up when it is expensive;
        #: else exactly `repeats` timed rounds
        self.repeats, self.budget_s, self.adaptive = repeats, budget_s, adaptive
        self.clock = trials.Clock(sync)
        self._timed = lambda _name, run: self.clock.time(run, self._inputs)
        self.trial = trial or self._timed
        self.guard = guard or trials.Guard()
        self.criterion = criterion or Fastest()
        self.force_env, self.forceable, self.aliases = force_env, tuple(forceable), dict(aliases or {})
        self.preference, self.check, self.baseline, self.name = tuple(preference), check, baseline, name
        self.choices: dict[tuple, Choice] = {}
        self.notify: Callable[[str], None] | None = None
        #: agree(op, names, seconds) -> seconds: the timings every rank that must run the same
        #: kernel for `op` decides on (e.g. the MAX over the TP group)
        self.agree: Callable[[str, list, list], list] | None = None
        self._noted: set[str] = set()
        self._inputs: tuple = ()
        _ALL.add(self)

    def configure(self, *, sync=None, guard=None, notify=None, agree=None, events=None) -> None:
        """The accelerator's synchronize, Event class (device timing) and state guard, where the
        one note per op goes, and how ranks agree on the timings (`agree`, see __init__)."""
        if agree is not None:
            self.agree = agree
        if sync is not None:
            self.clock.sync = sync
        if events is not None:
            self.clock.events = events
        if guard is not None:
            self.guard = guard
        if notify is not None:
            self.notify = notify

    @property
    def real_clock(self) -> bool:
        """Whether trials read the clock (not timings a test injected)."""
        return self.trial is self._timed

    def clear(self) -> None:
        self.choices.clear()
        self._noted.clear()

    def forced(self) -> str | None:
        """The path `force_env` forces, or None (auto)."""
        if self.force_env is None:
            return None
        value = os.environ.get(self.force_env, "auto").strip().lower() or "auto"
        if value not in ("auto",) + self.forceable + tuple(self.aliases):
            raise ValueError(f"{self.force_env}={value!r}: use one of "
                             f"{', '.join(('auto',) + self.forceable + tuple(self.aliases))}")
        return None if value == "auto" else value

    def pick(self, op: str, key: tuple, text: str, candidates: dict[str, Callable], inputs: tuple, *,
             fixed: str | None = None, fixed_by: str = "", timed: bool = True, untimed_why: str = "",
             nbytes: dict[str, int] | None = None, grads: bool | None = None) -> Choice:
        """The cached choice for `key`, measuring the candidates on `inputs` the first time.
        `candidates` maps name -> fn(*inputs) -> output (None: in place); it holds the baseline.
        `fixed` (a flag's value) or the forcing variable decide without a trial; `timed=False`
        decides without a timing (as --deterministic-mode does, with `untimed_why` as the
        reason); `nbytes` gives each candidate's bytes where the feature knows them."""
        hit = self.choices.get(key)
        if hit is not None:
            return hit
        from npuspeed.ops.choose import measure

        want, by = (fixed, fixed_by) if fixed else (self.forced(), "")
        by = by or f"forced by {self.force_env}={want}"
        grads = any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs) if grads is None else grads
        if want is not None:
            choice = self._checked(self._force(op, text, candidates, want, by), candidates, inputs)
        elif len(candidates) == 1:
            (only,) = candidates
            choice = Choice(op, text, only, untimed_why or "the only implementation here", baseline=self.baseline)
        elif trials.traced(inputs):
            choice = Choice(op, text, self.baseline, "not measured: traced or fake tensors", baseline=self.baseline)
        elif torch.are_deterministic_algorithms_enabled() or not timed:
            why = DETERMINISTIC if torch.are_deterministic_algorithms_enabled() else untimed_why
            choice = self._checked(measure.untimed(self, op, text, candidates, inputs, grads, nbytes, why),
                                   candidates, inputs)
        else:
            self._inputs = inputs
            try:
                choice = measure.timed(self, op, text, candidates, inputs, grads, nbytes)
            finally:
                self._inputs = ()  # the trial's inputs are not kept alive by the cache
        self.choices[key] = choice
        self._say(choice)
        return choice

    def _say(self, choice: Choice) -> None:
        for name, reason in choice.dropped.items():
            self._note(f"{choice.op}:{name}", f"fused {choice.op}: {name} dropped for {choice.label}: {reason}; "
                       f"another path runs there (`npuspeed report` lists every shape)")
        if choice.impl == self.baseline and choice.ms:
            timings = choice.why.split(": ", 1)[-1]
            self._note(choice.op, f"fused {choice.op}: Megatron's own path runs for {choice.label}, measured "
                       f"faster than the fused kernels there ({timings}); `npuspeed report` lists every shape")

    def _note(self, what: str, message: str) -> None:
        if self.notify is not None and what not in self._noted:
            self._noted.add(what)
            self.notify(message)

    def ordered(self, candidates) -> list[str]:
        """The preference order among `candidates` where no timing decides, baseline last."""
        if self.preference:  # only the declared ones (e.g. the flag's own kernels) beat the baseline
            return [n for n in self.preference if n in candidates and n != self.baseline] + [self.baseline]
        return [n for n in candidates if n != self.baseline] + [self.baseline]

    def _force(self, op, text, candidates, want, by) -> Choice:
        names = self.aliases.get(want, (want,))
        for name in names:
            if name in candidates:
                return Choice(op, text, name, by, baseline=self.baseline)
        return Choice(op, text, self.baseline, f"{by}; {want} is not available for this call", baseline=self.baseline)

    def _checked(self, choice: Choice, candidates, inputs) -> Choice:
        """A kernel that runs unmeasured (forced, or untimed), checked once per key against the
        baseline's forward output with the trial's tolerance: one the rule would drop for
        disagreeing raises here instead of running on wrong numbers."""
        if not self.check or choice.impl == self.baseline or self.baseline not in candidates or trials.traced(inputs):
            return choice
        with self.guard(), _dispatch.quiet(), torch.no_grad():
            try:
                reference = trials.Run(candidates[self.baseline], inputs, False)()
            except Exception as exc:  # noqa: BLE001 - nothing to compare with; the forced kernel still runs
                choice.why += f"; not checked: Megatron's path raised {type(exc).__name__}"
                return choice
            out = trials.Run(candidates[choice.impl], inputs, False)()
        if not trials.agrees(out, reference):
            raise trials.ForcedKernelDisagrees(
                f"fused {choice.op} [{choice.label}]: {choice.impl} ({choice.why}) disagrees with Megatron's "
                f"path: {trials.gap(out, reference)}; fix the kernel, or unset {self.force_env} (the rule then "
                f"drops it)")
        return choice


def all_choosers() -> list[Chooser]:
    return list(_ALL)
