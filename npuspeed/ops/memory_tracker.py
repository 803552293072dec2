"""Live-byte counts for CPU tensors, from the tracking allocator in csrc/cpu/memory_tracker.cpp.

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
    return list(ops.memory_tracker_stats()) if ops is not None else [0, 0, 0, 0]


def enabled() -> bool:
    return bool(_stats()[3])


def allocated() -> int:
    return _stats()[0]


def peak() -> int:
    return _stats()[1]


def num_allocations() -> int:
    return _stats()[2]


def reset_peak() -> None:
    ops = _ops()
    if ops is not None:
        ops.memory_tracker_reset_peak()


def describe() -> str:
    if enabled():
        return "tracking CPU allocator (live storage bytes)"
    return f"unavailable: {load_library()['error'] or 'tracking allocator not enabled'}"
