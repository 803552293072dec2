"""How a chooser ranks the candidates that survived the warm-up: by time, or by bytes first.

A speed feature takes the fastest (`Fastest`; with `no_larger` never one that holds more bytes
than the baseline). A feature whose point is memory takes the smallest among those within a
stated time allowance of the baseline (`Smallest`), so its memory effect does not hang on a
timing race. Ties go to the baseline (Megatron's path). Untimed (--deterministic-mode, or no
trial on this device) the bytes alone decide where the criterion reads them, else the
feature's order of preference: the same answer in every run and on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass


def _first(pool: list[str], preference: list[str]) -> str:
    return next(n for n in preference if n in pool)


@dataclass(frozen=True)
class Fastest:
    """The fastest candidate; `no_larger`: none that holds more bytes than the baseline."""

    no_larger: bool = False

    @property
    def reads_bytes(self) -> bool:
        return self.no_larger

    def decide(self, names, ms, nbytes, baseline, preference) -> str:
        pool = list(names)
        if self.no_larger and baseline in nbytes:
            pool = [n for n in pool if nbytes.get(n, 0) <= nbytes[baseline]]
        if ms:
            return min(pool, key=lambda n: (ms[n], n != baseline))
        return _first(pool, preference)

    def describe(self) -> str:
        return "fastest" + (", never larger than Megatron's" if self.no_larger else "")


@dataclass(frozen=True)
class Smallest:
    """The fewest peak bytes among candidates at most `allowance` x the baseline's time."""

    allowance: float
    reads_bytes = True

    def decide(self, names, ms, nbytes, baseline, preference) -> str:
        pool = [n for n in names if not ms or ms[n] <= self.allowance * ms[baseline]]
        if all(n in nbytes for n in pool):
            return min(pool, key=lambda n: (nbytes[n], n != baseline))
        return _first(pool, preference)

    def describe(self) -> str:
        return f"fewest bytes within {self.allowance:.2f}x Megatron's time"
