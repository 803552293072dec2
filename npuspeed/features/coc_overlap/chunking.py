"""How many chunks one call's rows are cut into.

`--coc-parallel-num N` is a request. Every rank's chunk i must have the same number of rows
for the collective, and the chunk-major results are put back rank-major, so the local row
count M (tokens per rank) is split into equal chunks. When N does not divide M the nearest
divisor of M is used instead (ties go to the larger: more overlap), and one log line per
(M, N) says so: the fallback is never silent, not even when it comes down to one chunk.
"""
from __future__ import annotations

import functools
import logging

from npuspeed import telemetry

log = logging.getLogger("npuspeed")
ONCE = "coc.chunks"  # telemetry.once key prefix of the shapes already logged


@functools.lru_cache(maxsize=256)
def nearest_divisor(m: int, n: int) -> int:
    """The divisor of m closest to n (the larger one on a tie); 1 for m < 1."""
    if m < 1:
        return 1
    divisors = set()
    d = 1
    while d * d <= m:
        if m % d == 0:
            divisors.update((d, m // d))
        d += 1
    return min(divisors, key=lambda k: (abs(k - n), -k))


def chunk_count(m: int, n: int, where: str, note=None) -> int:
    """Chunks for `m` rows when `n` were asked for; says so once per (where, m, n) if it
    differs, through `note` (the run's note sink) or the log."""
    chosen = nearest_divisor(m, n)
    if chosen != n and telemetry.once((ONCE, where, m, n)):
        message = (f"--coc-parallel-num {n}: {where} has {m} rows per rank, not divisible by {n}; "
                   f"using {chosen} chunk{'s' if chosen != 1 else ''} of {m // chosen} rows for this shape")
        (note or log.warning)(message)
    return chosen


def logged_shapes() -> set:
    """(where, m, n) of every fallback logged so far (tests)."""
    return {key[1:] for key in telemetry.seen_once(ONCE)}
