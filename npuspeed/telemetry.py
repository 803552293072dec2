"""One counter registry for every feature and op: what ran, how often, and the last call.

Tests prove a fast path ran by its counter (a silent fallback cannot pass), benchmarks assert
the feature they time was used, and `npuspeed report --json` shows the counts. Before this
module each feature kept its own counter in its own shape, each reset by hand in tests.

Names are dotted, feature first: `attention.kernel.sdpa`, `ops.rms_norm.cpp`,
`coc.collective.all_gather`, `recompute.freed_bytes`. `once(key)` is the "log this only the
first time" set the features used to keep privately; `reset()` clears it too.
This module imports nothing from npuspeed: every layer may use it.
"""
from __future__ import annotations

import collections
import threading

_LOCK = threading.Lock()
_COUNTS: collections.Counter = collections.Counter()
_LAST: dict[str, dict] = {}
_ONCE: set = set()


def count(name: str, n: int = 1) -> None:
    """Add `n` to counter `name`."""
    with _LOCK:
        _COUNTS[name] += n


def get(name: str) -> int:
    return _COUNTS.get(name, 0)


def record(name: str, **fields) -> None:
    """Keep the details of the latest call of `name` (e.g. which mask an attention call had)."""
    _LAST[name] = fields


def last(name: str) -> dict:
    return dict(_LAST.get(name, {}))


def snapshot(prefix: str = "") -> dict[str, int]:
    """Counters whose name starts with `prefix` (all by default), as a plain dict."""
    with _LOCK:
        return {k: v for k, v in _COUNTS.items() if k.startswith(prefix) and v}


def since(before: dict[str, int], prefix: str = "") -> dict[str, int]:
    """What was counted after `before = snapshot(prefix)` was taken (non-zero entries)."""
    now = snapshot(prefix)
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


def once(key) -> bool:
    """True the first time `key` is seen (since the last reset), False after."""
    with _LOCK:
        if key in _ONCE:
            return False
        _ONCE.add(key)
        return True


def seen_once(prefix=None) -> set:
    """Keys given to `once` so far; tuples whose first element is `prefix` when given."""
    return {k for k in _ONCE if prefix is None or (isinstance(k, tuple) and k and k[0] == prefix)}


def reset(prefix: str = "") -> None:
    """Forget counters (and last calls) under `prefix`; with no prefix, the once-keys too."""
    with _LOCK:
        for key in [k for k in _COUNTS if k.startswith(prefix)]:
            del _COUNTS[key]
        for key in [k for k in _LAST if k.startswith(prefix)]:
            del _LAST[key]
        if not prefix:
            _ONCE.clear()
