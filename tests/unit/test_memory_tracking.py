"""CPU memory statistics come from the tracking allocator: exact live-byte counts.

The device feature's `prepare` turns tracking on (npuspeed_runtime); only storages
allocated after that are counted, which is every tensor made in these tests.
"""
from __future__ import annotations

import gc

import pytest
import torch

from npuspeed.ops import memory_tracker

N = 3 * 1024 * 1024 + 7  # odd, so no rounding hides in the count


@pytest.fixture
def acc(npuspeed_runtime):
    acc = npuspeed_runtime.accelerator
    if acc.name != "cpu":
        pytest.skip("the tracking allocator is the CPU backend's")
    assert memory_tracker.enabled(), acc.memory_tracking()
    gc.collect()
    return acc


def test_allocate_and_free_exact(acc):
    acc.reset_peak_memory_stats()
    base = acc.memory_allocated()
    assert acc.max_memory_allocated() == base
    t = torch.empty(N, dtype=torch.uint8)
    assert acc.memory_allocated() == base + N
    assert acc.max_memory_allocated() == base + N
    u = torch.empty(N // 4, dtype=torch.float32)  # 4 bytes each
    assert acc.memory_allocated() == base + N + (N // 4) * 4
    del t
    assert acc.memory_allocated() == base + (N // 4) * 4
    assert acc.max_memory_allocated() == base + N + (N // 4) * 4  # peak stays
    del u
    assert acc.memory_allocated() == base
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() == base


def test_storage_resize_is_counted(acc):
    t = torch.ones(N, dtype=torch.uint8)
    base = acc.memory_allocated()
    t.untyped_storage().resize_(0)
    assert acc.memory_allocated() == base - N
    t.untyped_storage().resize_(N)
    assert acc.memory_allocated() == base
    acc.reset_peak_memory_stats()
    t.untyped_storage().resize_(2 * N)  # a regrowth holds old and new storage for a moment
    assert acc.memory_allocated() == base + N
    assert acc.max_memory_allocated() >= base + N
    del t


def test_views_and_ops_count_only_new_storage(acc):
    a = torch.zeros(N // 4, dtype=torch.float32)
    base = acc.memory_allocated()
    view = a[10:]  # no storage
    assert acc.memory_allocated() == base
    b = a + 1  # a new result storage
    assert acc.memory_allocated() == base + (N // 4) * 4
    del view, b, a


def test_torch_cuda_shim_reports_the_same_numbers(acc):
    assert torch.cuda.max_memory_allocated.__npuspeed_patch__ == "torch.cuda.max_memory_allocated"
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == acc.max_memory_allocated() == acc.memory_allocated()
    t = torch.empty(N, dtype=torch.uint8)
    assert torch.cuda.memory_allocated() == acc.memory_allocated()
    assert torch.cuda.max_memory_allocated() == acc.max_memory_allocated() == acc.memory_allocated()
    stats = torch.cuda.memory_stats()
    assert stats["allocated_bytes.all.current"] == acc.memory_allocated()
    assert stats["allocated_bytes.all.peak"] == acc.max_memory_allocated()
    before = torch.cuda.memory_allocated()
    del t
    assert torch.cuda.memory_allocated() == before - N
    assert torch.cuda.max_memory_allocated() == before
    torch.cuda.reset_max_memory_allocated()
    assert torch.cuda.max_memory_allocated() == before - N
    assert "tracking" in acc.memory_tracking()
