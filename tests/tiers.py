"""Which backend a test runs on, decided in one place.

Two tiers. The CPU tier (`make test`, what CI runs) pins npuspeed's CPU backend for the test
process and for every process it starts, so it passes on a GPU or NPU host too: its tests build
CPU tensors and compare with CPU references, and npuspeed would otherwise pick the accelerator.
The device tier (`make test-device`, tests/device/, selected by `-m device`) leaves the choice
to npuspeed's detection and runs the features on the accelerator present.

conftest.py applies the pin; helpers that build a child's environment from scratch (or drop a
user's NPUSPEED_* variables) call `pinned(env)` so that the child keeps it.
"""
from __future__ import annotations

import os

VAR = "NPUSPEED_DEVICE"
CPU = "cpu"
DEVICE_MARK = "device"


def device_tier(markexpr: str) -> bool:
    """True when pytest's `-m` expression selects the device tier's tests (marked `device`) and
    none of the CPU tier's (unmarked), e.g. `-m device`; False for the default
    `-m "not slow and not device"`, for `-m slow`, and for an expression selecting both (the
    CPU tests keep their pin; the device tests name their device themselves)."""
    markexpr = (markexpr or "").strip()
    if not markexpr:
        return False
    try:
        from _pytest.mark.expression import Expression
    except ImportError:  # an older pytest: the plain spelling only
        return markexpr == DEVICE_MARK
    expr = Expression.compile(markexpr)

    def selects(marks: set) -> bool:
        return bool(expr.evaluate(lambda name, **_kw: name in marks))

    return selects({DEVICE_MARK}) and not selects(set())


def pin(environ=None) -> None:
    """Pin the CPU backend in `environ` (os.environ by default) and forget an accelerator
    npuspeed may already have picked in this process."""
    environ = os.environ if environ is None else environ
    environ[VAR] = CPU
    import sys

    if "npuspeed.accelerator" in sys.modules:
        sys.modules["npuspeed.accelerator"].reset_accelerator()


def pinned(env: dict) -> dict:
    """`env` with the CPU tier's backend pin (for a child process of a CPU-tier test)."""
    env[VAR] = CPU
    return env
