"""The device tier (`make test-device`, `-m device`): every test here trains on the accelerator
present; on a host without one each is skipped with the one reason below, and the tier still
exits 0 (skipped tests count as run). Where the host names an accelerator this Python's torch does
not see, the tier fails in one line before any test runs (tests/tiers.py: device_refusal)."""
from __future__ import annotations

import pytest

import tiers
from device_runs import ON_HOST, REASON, accelerator, runs_done


def pytest_collection_modifyitems(config, items):
    """The device tier (`-m device`) on a host that names an accelerator its torch cannot see
    (e.g. NPUSPEED_DEVICE=cuda with a CPU build): one line and a failing exit, not green skips.
    NPUSPEED_DEVICE_TIER_HOST=cpu (the tier's own code on the host) names the CPU on purpose."""
    if ON_HOST or not getattr(config, "_npuspeed_device_tier", False):
        return
    refusal = tiers.device_refusal(tiers.named_accelerator(), accelerator())
    if refusal:
        raise pytest.UsageError(refusal)


@pytest.fixture(autouse=True)
def _needs_accelerator():
    if accelerator() is None:
        pytest.skip(REASON)


def pytest_terminal_summary(terminalreporter):
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if REASON in str(r.longrepr)]
    if skipped:
        terminalreporter.write_line(f"device tier: {len(skipped)} tests skipped: {REASON}")
    count, seconds = runs_done()
    if count:
        terminalreporter.write_line(f"device tier: {count} runs of the example on {accelerator()}, {seconds:.0f} s")
