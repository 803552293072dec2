"""Live-byte counts for CPU tensors, and the cache of large freed blocks, from the tracking
allocator in csrc/cpu/memory_tracker.cpp.

Only storages allocated after `enable()` are counted; the adaptor enables it at import, before
any model exists. Without the op library the numbers are zero and `describe()` says why.
"""
from __future__ import annotations

import torch

from npuspeed.ops._extension import load_library


def _ops():
    return torch.ops.npuspeed if load_library()["compiled"] else None


def enable() -> bool:
    ops = _ops()
    return bool(ops.memory_tracker_enable()) if ops is not None else False


def _stats() -> list[int]:
    ops = _ops()
    return list(ops.memory_tracker_stats()) if ops is not None else [0] * 9


def enabled() -> bool:
    return bool(_stats()[3])


def allocated() -> int:
    return _stats()[0]


def peak() -> int:
    return _stats()[1]


def num_allocations() -> int:
    return _stats()[2]


def cached() -> int:
    """Bytes in freed blocks kept for reuse."""
    return _stats()[4]


def cache_hits() -> int:
    """Allocations served from the cache so far."""
    return _stats()[5]


def cache_limit() -> int:
    return _stats()[6]


def reserved() -> int:
    """Bytes of blocks not handed back to the system allocator: live ones and the cache."""
    return _stats()[7]


def peak_reserved() -> int:
    return _stats()[8]


def restore_peak(peak_bytes: int, peak_reserved_bytes: int) -> None:
    """Peaks back to at least these values (after a measurement that reset them)."""
    ops = _ops()
    if ops is not None:
        ops.memory_tracker_restore_peak(int(peak_bytes), int(peak_reserved_bytes))


def set_cache_limit(nbytes: int) -> None:
    """Keep freed blocks of >= 1 MiB up to `nbytes` in all (0: no cache)."""
    ops = _ops()
    if ops is not None:
        ops.memory_tracker_set_cache_limit(int(nbytes))
        if nbytes <= 0:
            ops.memory_tracker_empty_cache()


def empty_cache() -> None:
    ops = _ops()
    if ops is not None:
        ops.memory_tracker_empty_cache()


def reset_peak() -> None:
    ops = _ops()
    if ops is not None:
        ops.memory_tracker_reset_peak()


def describe() -> str:
    if enabled():
        return "tracking CPU allocator (live storage bytes)"
    return f"unavailable: {load_library()['error'] or 'tracking allocator not enabled'}"
