"""The device tier (`make test-device`, `-m device`): every test here trains on the accelerator
present; on a host without one each is skipped with the one reason below, and the tier still
exits 0 (skipped tests count as run)."""
from __future__ import annotations

import pytest

from device_runs import REASON, accelerator, runs_done


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
