"""--reuse-fp32-param on the accelerator: the codec runs on the device (split and merge, no host
round trip), losses are bitwise those of ordinary bf16 mixed precision under
--deterministic-mode (as on CPU), weight bytes are 0.67x (README) and the optimizer step's peak
is ordinary mixed precision's (the residuals are dropped while the masters exist)."""
from __future__ import annotations

import pytest

from device_runs import (
    DETERMINISTIC, MODEL, NO_DROPOUT, assert_deterministic, assert_on_device, counters, train,
)

pytestmark = pytest.mark.device

FLAG = ["--reuse-fp32-param"]
#: the caching allocator rounds each block up (512 B) and the step's scalars come and go
STEP_PEAK_SLACK = 0.01


def test_reuse_fp32_param(tmp_path_factory):
    base = train(tmp_path_factory, MODEL + NO_DROPOUT + DETERMINISTIC)
    run = train(tmp_path_factory, MODEL + NO_DROPOUT + DETERMINISTIC + FLAG)
    assert_on_device(base, run)
    assert_deterministic(base, run)
    codec = counters(run, "reuse.codec.")
    assert codec.get("reuse.codec.split.device", 0) > 0 and codec.get("reuse.codec.merge.device", 0) > 0, codec
    assert set(codec) == {"reuse.codec.split.device", "reuse.codec.merge.device"}, codec  # no CPU codec
    assert not counters(base, "reuse."), base["npuspeed_counters"]
    assert run["losses"] == base["losses"]
    ratio = run["weight_bytes"] / base["weight_bytes"]
    assert ratio <= 0.67 + 1e-3, f"weight bytes x{ratio:.3f} ({run['weight_bytes']} vs {base['weight_bytes']})"
    step, base_step = run["optimizer_step_peak_bytes"], base["optimizer_step_peak_bytes"]
    assert step <= base_step * (1 + STEP_PEAK_SLACK), (step, base_step)
