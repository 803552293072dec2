"""`npuspeed plan` on the accelerator: its predicted peak against the peak the device allocator
measured (max_memory_allocated, the summary's peak_mem_bytes) for the same flags, within the 10%
the CPU tier holds it to (tests/e2e/test_plan_memory.py)."""
from __future__ import annotations

import pytest

from device_checks import assert_on_device
from device_runs import MODEL, NO_DROPOUT, plan_peak, train

pytestmark = pytest.mark.device
COVERS = ()  # `npuspeed plan`: no flag of its own

TOL = 0.10
CASES = {
    "megatron-unfused": [],
    "flash-attn": ["--use-flash-attn"],
    "flash-attn reuse-fp32 recompute-activation": ["--use-flash-attn", "--reuse-fp32-param",
                                                   "--recompute-activation-function"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_predicted_peak_within_10_percent(tmp_path_factory, name):
    args = MODEL + NO_DROPOUT + CASES[name]
    run = train(tmp_path_factory, args)
    assert_on_device(run)
    measured, predicted = run["peak_mem_bytes"], plan_peak(args)
    assert abs(predicted / measured - 1) <= TOL, (f"{name}: predicted {predicted / 2**20:.0f} MiB, measured "
                                                  f"{measured / 2**20:.0f} MiB (x{predicted / measured:.3f})")
