"""The CPU allocator's block cache: a storage freed and grown again faults no pages in.

Each setting runs in its own interpreter (the allocator is process-wide) and counts the minor
page faults of growing four 16 MiB storages back after `resize_(0)` with other blocks taken
in between, as activations and the features' released storages do between steps.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from npuspeed.accelerator import AcceleratorError
from npuspeed.accelerator.cpu import CACHE_ENV, CpuAccelerator
from npuspeed.ops import memory_tracker

PROBE = r"""
import json, resource, torch
from npuspeed.accelerator.cpu import CpuAccelerator
acc = CpuAccelerator()
acc.enable_memory_tracking()
policy = acc.configure_host_cache()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
kept = [torch.ones(4 << 20) for _ in range(4)]  # 4 x 16 MiB
steps = []
for _ in range(3):
    before = faults()
    for t in kept:
        t.untyped_storage().resize_(0)
    scratch = [torch.ones(4 << 20) for _ in range(2)]
    del scratch
    for t in kept:
        t.untyped_storage().resize_(16 << 20)
        t.fill_(2.0)
    steps.append({"faults": faults() - before, "allocated": acc.memory_allocated(),
                  "reserved": acc.memory_reserved()})
from npuspeed.ops import memory_tracker
held = torch.ones(4 << 20)
del held  # now cached: reserved, not allocated
print(json.dumps({"policy": policy, "steps": steps, "ok": all(bool((t == 2).all()) for t in kept),
                  "hits": memory_tracker.cache_hits(), "cached": memory_tracker.cached(),
                  "reserved": acc.memory_reserved(), "allocated": acc.memory_allocated(),
                  "max_reserved": acc.max_memory_reserved()}))
"""


def _probe(mib: str | None) -> dict:
    env = dict(os.environ)
    env.pop(CACHE_ENV, None)
    if mib is not None:
        env[CACHE_ENV] = mib
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not memory_tracker.enable(), reason="needs the compiled op library")
def test_freed_blocks_are_reused_without_page_faults():
    cached, off = _probe(None), _probe("0")
    assert "kept for reuse, up to 2048 MiB" in cached["policy"] and off["policy"] == f"off ({CACHE_ENV}=0)"
    assert cached["ok"] and off["ok"]
    pages = 4 * (16 << 20) // 4096
    assert max(s["faults"] for s in cached["steps"][1:]) < pages // 20, cached
    # glibc alone: the first regrowth faults the pages in again (later ones vary as glibc adapts
    # its mmap threshold); over the steps the cache faults at most a tenth as often
    assert off["steps"][0]["faults"] > pages // 2, off
    assert sum(s["faults"] for s in cached["steps"]) < sum(s["faults"] for s in off["steps"]) // 10
    assert cached["hits"] >= 3 * 6 and off["hits"] == 0
    # live bytes count tensors only; a cached block shows as reserved
    assert all(s["allocated"] == 4 * (16 << 20) for s in cached["steps"] + off["steps"])
    assert cached["cached"] >= 16 << 20 and cached["reserved"] == cached["allocated"] + cached["cached"]
    assert off["cached"] == 0 and off["reserved"] == off["allocated"]
    for run in (cached, off):
        assert run["max_reserved"] >= run["reserved"] >= 4 * (16 << 20)


def test_bad_cache_size_names_the_variable(monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "lots")
    with pytest.raises(AcceleratorError, match="NPUSPEED_CPU_CACHE_MB='lots'.*or 0 to turn"):
        CpuAccelerator().configure_host_cache()
