"""Save and resume on the accelerator, bitwise under --deterministic-mode: two identical runs
give identical losses, and a run resumed from the middle iteration (4 of 8) continues exactly as the uninterrupted
run did (model, optimizer, and every RNG state: host, device, Megatron's tracker). Megatron's
default dropout (0.1) and the fused attention's device kernel are on, so the device's random
state has to come back too."""
from __future__ import annotations

import pytest

from device_checks import assert_deterministic, assert_on_device
from device_runs import ATTENTION_KERNEL, DETERMINISTIC, ITERS, MODEL, accelerator, train

pytestmark = pytest.mark.device

SAVE_AT = ITERS // 2
COVERS = ()  # save and resume: no npuspeed flag (--deterministic-mode: test_determinism_on_device.py)
ARGS = MODEL + DETERMINISTIC + ["--use-flash-attn"]  # hidden and attention dropout: Megatron's 0.1


def test_save_and_resume_is_bitwise(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("device_ckpt")
    full = train(tmp_path_factory, ARGS + ["--save", str(ckpt), "--save-interval", str(SAVE_AT)])
    again = train(tmp_path_factory, ARGS)
    assert (ckpt / f"iter_{SAVE_AT:07d}").is_dir(), sorted(p.name for p in ckpt.iterdir())
    resumed = train(tmp_path_factory, ARGS + ["--load", str(ckpt), "--ckpt-step", str(SAVE_AT)])
    assert_on_device(full, again, resumed)
    assert_deterministic(full, again, resumed)
    kernel = ATTENTION_KERNEL[accelerator()]
    for run in (full, resumed):
        assert set(run["attention_calls"]["calls"]) == {kernel}, run["attention_calls"]
    assert full["attention_last"]["dropout_p"] == pytest.approx(0.1), full["attention_last"]
    assert again["losses"] == full["losses"], "two runs under --deterministic-mode differ"
    assert resumed["first_iteration"] == SAVE_AT + 1 and len(resumed["losses"]) == ITERS - SAVE_AT
    assert resumed["losses"] == full["losses"][SAVE_AT:]
