"""Which backend a test runs on, decided in one place.

Two tiers. The CPU tier (`make test`, what CI runs) pins npuspeed's CPU backend for the test
process and for every process it starts, so it passes on a GPU or NPU host too: its tests build
CPU tensors and compare with CPU references, and npuspeed would otherwise pick the accelerator.
The device tier (`make test-device`, tests/device/, selected by `-m device`) leaves the choice
to npuspeed's detection and runs the features on the accelerator present.

conftest.py applies the pin; helpers that build a child's environment from scratch (or drop a
user's NPUSPEED_* variables) call `pinned(env)` so that the child keeps it.

Where the host names an accelerator (NPUSPEED_DEVICE=cuda/npu, nvidia-smi lists a GPU, npu-smi an
NPU) that this Python's torch does not see, the device tier fails in one line
(`device_refusal`, raised by tests/device/conftest.py) instead of skipping green: the rule
scripts/device_python.sh applies before `make test-device` picks its Python.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

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


def named_accelerator(environ=None) -> str | None:
    """The accelerator this host says it has, worded as scripts/device_python.sh words it, e.g.
    "cuda (NPUSPEED_DEVICE=cuda)"; None where nothing names one."""
    environ = os.environ if environ is None else environ
    name = environ.get(VAR, "")
    if name in ("cuda", "npu"):
        return f"{name} ({VAR}={name})"

    def lists(cmd: list) -> subprocess.CompletedProcess | None:
        if shutil.which(cmd[0]) is None:
            return None
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None

    smi = lists(["nvidia-smi", "-L"])
    if smi is not None and "GPU" in smi.stdout:
        return "cuda (nvidia-smi lists a GPU)"
    smi = lists(["npu-smi", "info"])
    if smi is not None and smi.returncode == 0:
        return "npu (npu-smi lists an NPU)"
    return None


def device_refusal(named: str | None, seen: str | None) -> str | None:
    """The device tier's one-line refusal where the host names an accelerator (`named`, from
    named_accelerator) that npuspeed, under this Python's torch, does not detect (`seen`: "cuda",
    "npu" or None); None where there is nothing to refuse."""
    if named is None:
        return None
    kind = named.split()[0]
    if seen == kind:
        return None
    build = f"a {kind} build of torch" + (" with torch_npu" if kind == "npu" else "")
    return (f"device tier: this host has {named}, but this Python's torch ({sys.executable}) does not see it: "
            f"install {build}, or run `make test-device` (it finds a Python that sees it; "
            f"DEVICE_PY=/path/to/python names one)")
