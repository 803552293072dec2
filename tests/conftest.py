"""Shared fixtures. Tests run in one process: anything patched is undone by its fixture.

The CPU tier pins npuspeed's CPU backend here (NPUSPEED_DEVICE=cpu, inherited by every process
a test starts) unless the device tier runs (`-m device`, tests/device/); see tests/tiers.py."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tools"))  # launch.py, shared with the benchmarks

from feature_ctx import features_enabled  # noqa: E402
from launch import free_port  # noqa: E402
import shards  # noqa: E402
import tiers  # noqa: E402


def pytest_configure(config):
    """Before any test module is imported: the CPU tier's backend pin (a user's NPUSPEED_DEVICE
    included: `make test` must pass on a GPU host whatever the shell exports)."""
    config._npuspeed_device_tier = tiers.device_tier(config.getoption("markexpr", "") or "")
    if not config._npuspeed_device_tier:
        tiers.pin()


def pytest_report_header(config):
    if getattr(config, "_npuspeed_device_tier", False):
        return "npuspeed: device tier (the accelerator present, NPUSPEED_DEVICE not pinned)"
    here = shards.shard()
    share = f"; {shards.VAR}={here}: this Python's share of the multi-process files (tests/shards.py)" if here else ""
    return f"npuspeed: CPU tier ({tiers.VAR}={os.environ.get(tiers.VAR)} pinned for tests and their subprocesses){share}"


def pytest_collection_modifyitems(config, items):
    """`make test`'s split of the multi-process files between the two Pythons (tests/shards.py)."""
    here = shards.shard()
    if here is None:
        return
    tests_dir = os.path.join(ROOT, "tests")
    keep, drop = [], []
    for item in items:
        (keep if shards.runs_here(item.path, tests_dir, here) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def npuspeed_runtime():
    """The device feature applied, as `import npuspeed.megatron_adaptor` does with no flags."""
    from npuspeed import runtime

    return runtime.initialize([])


@pytest.fixture(scope="module")
def megatron_mp(npuspeed_runtime):
    """A 1-rank gloo group with Megatron's model-parallel state (TP=PP=1) and its RNG tracker."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    own_pg = not dist.is_initialized()
    if own_pg:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    own_mp = not parallel_state.model_parallel_is_initialized()
    if own_mp:
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    yield npuspeed_runtime
    if own_mp:
        parallel_state.destroy_model_parallel()
    if own_pg:
        dist.destroy_process_group()


@pytest.fixture
def with_features(npuspeed_runtime):
    return features_enabled
