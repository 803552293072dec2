"""Host memory a conversion gives back as it goes.

A conversion makes each tensor once, in many sizes, and drops it after writing it; two
allocators would keep what it drops: npuspeed's CPU block cache (the CPU backend's, kept for
reuse as a device's caching allocator does) and glibc's malloc, whose mmap threshold grows to
the largest block freed so far (up to 32 MiB), so later blocks of that size come from the heap
and stay mapped once freed. On the 156M Llama of docs/convert.md they added 43 and 64 MiB.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools


@contextlib.contextmanager
def cache_off():
    """npuspeed's CPU block cache off (and emptied) inside, as it was after."""
    from npuspeed.ops import memory_tracker

    if not memory_tracker.enabled():
        yield
        return
    limit = memory_tracker.cache_limit()
    memory_tracker.set_cache_limit(0)
    try:
        yield
    finally:
        memory_tracker.set_cache_limit(limit)


@functools.cache
def _malloc_trim():
    return getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only; elsewhere nothing to do


def give_back() -> None:
    """Return the heap's free pages to the system (glibc's malloc_trim)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
