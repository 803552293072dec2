"""Shared fixtures. Tests run in one process: anything patched is undone by its fixture."""
from __future__ import annotations

import contextlib
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "tests"))


@pytest.fixture(scope="session")
def npuspeed_runtime():
    """The device feature applied, as `import npuspeed.megatron_adaptor` does with no flags."""
    from npuspeed import runtime

    return runtime.initialize([])


@contextlib.contextmanager
def features_enabled(argv: list[str]):
    """Turn on the opt-in features named by `argv` on top of the runtime; undo them after."""
    from npuspeed import arguments, runtime
    from npuspeed.patching import registry

    state = runtime.initialize([])
    args = arguments.parse_args(argv)
    from npuspeed.features import all_features

    active = [f for f in all_features() if not f.always_on and f.enabled(args)]
    try:
        for feature in active:
            feature.validate(args, state.accelerator)
            feature.prepare(args, state.accelerator)
            feature.register_patches(registry, args, state.accelerator)
        registry.apply()
        yield args
    finally:
        for feature in active:
            registry.remove(feature.name)


@pytest.fixture
def with_features(npuspeed_runtime):
    return features_enabled
