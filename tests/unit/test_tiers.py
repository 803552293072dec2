"""The two test tiers: the CPU tier's backend pin reaches this process and its children, the
`-m` expressions select the tiers as the Makefile means them, and without an accelerator the
device tier skips every test with one reason and exits 0 (tests/tiers.py, tests/device/)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from launch import ROOT
from tiers import device_tier

from npuspeed.accelerator import get_accelerator


@pytest.mark.parametrize("expr,device", [
    ("not slow and not device", False),  # pytest.ini's default: `make test`
    ("slow", False),  # `make bench`
    ("", False),
    ("device", True),  # `make test-device`
    ("device and not slow", True),
    ("device or not device", False),  # both tiers at once: the CPU tests keep their pin
])
def test_mark_expressions_select_the_tier(expr, device):
    assert device_tier(expr) is device


def test_cpu_tier_pins_the_cpu_backend_here_and_in_children():
    assert os.environ["NPUSPEED_DEVICE"] == "cpu"
    assert get_accelerator().name == "cpu"
    code = "import npuspeed; print(npuspeed.get_accelerator().name)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "cpu"


def _pytest(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NPUSPEED_DEVICE="")  # as `make test-device` runs it
    return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_device_tier_without_an_accelerator_skips_with_one_reason():
    sys.path.insert(0, str(ROOT / "tests" / "device"))
    from device_runs import REASON, accelerator

    if accelerator() is not None:
        pytest.skip("an accelerator is present here: `make test-device` runs the device tier for real")
    proc = _pytest("-q", "-m", "device", "tests/device")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]  # skipped tests count: not 5 ("no tests ran")
    assert " skipped" in out and " passed" not in out and " failed" not in out, out[-3000:]
    assert out.count(REASON) == 1, out[-3000:]
    # and `make test` (pytest.ini's default -m) leaves them out
    collected = _pytest("-q", "--collect-only", "tests/device")
    assert re.search(r"no tests collected \(\d+ deselected\)", collected.stdout), collected.stdout[-2000:]


def test_device_refusal_names_what_the_host_has_and_the_fix():
    from tiers import device_refusal, named_accelerator

    assert named_accelerator({"NPUSPEED_DEVICE": "npu"}) == "npu (NPUSPEED_DEVICE=npu)"
    assert device_refusal(None, None) is None  # nothing named: the tier skips with its reason
    assert device_refusal("cuda (nvidia-smi lists a GPU)", "cuda") is None  # named and seen: it runs
    line = device_refusal("cuda (NPUSPEED_DEVICE=cuda)", None)
    assert "\n" not in line and "NPUSPEED_DEVICE=cuda" in line and "DEVICE_PY=" in line
    assert "torch_npu" in device_refusal("npu (npu-smi lists an NPU)", "cuda")


def test_device_tier_fails_in_one_line_where_an_accelerator_is_named_but_unseen():
    """`pytest -m device` itself (not only `make test-device`) refuses NPUSPEED_DEVICE=cuda on a
    host whose torch sees no GPU, instead of skipping green."""
    sys.path.insert(0, str(ROOT / "tests" / "device"))
    from device_runs import accelerator

    if accelerator() == "cuda":
        pytest.skip("torch sees a GPU here: NPUSPEED_DEVICE=cuda is honoured, nothing to refuse")
    env = dict(os.environ, NPUSPEED_DEVICE="cuda")
    env.pop("NPUSPEED_DEVICE_TIER_HOST", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "device",
                           "tests/device/test_checkpoint_on_device.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    lines = [ln for ln in out.splitlines() if "this host has cuda (NPUSPEED_DEVICE=cuda)" in ln]
    assert len(lines) == 1 and "does not see it" in lines[0], out[-3000:]
    assert " passed" not in out and " skipped" not in out, out[-3000:]
