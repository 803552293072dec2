"""--npuspeed-adam on the accelerator: without Transformer Engine and apex megatron-core builds
torch's AdamW (foreach on a device); npuspeed's default (`auto`) turns it into torch's fused
kernel, `--npuspeed-adam megatron` leaves it as built. README: the fused kernel ran every step
(the summary's counters and its `adam_implementation`), the losses agree with Megatron's own
optimizer within bf16 tolerance, and the step is not slower."""
from __future__ import annotations

import pytest

from device_checks import assert_not_slower, assert_on_device, assert_parity, counters
from device_runs import ITERS, MODEL, NO_DROPOUT, train

pytestmark = pytest.mark.device
COVERS = ("--npuspeed-adam",)

ARGS = MODEL + NO_DROPOUT


def test_fused_adam(tmp_path_factory):
    fused = train(tmp_path_factory, ARGS)  # the default: auto
    megatron = train(tmp_path_factory, ARGS + ["--npuspeed-adam", "megatron"])
    assert_on_device(fused, megatron)
    c = counters(fused, "adam.")
    assert c.get("adam.fused_steps") == ITERS and c.get("adam.fused_optimizers", 0) >= 1, c
    assert "fused=True" in (fused["adam_implementation"] or ""), fused["adam_implementation"]
    assert not counters(megatron, "adam.fused_steps"), megatron["npuspeed_counters"]
    assert "Megatron's default" in (megatron["adam_implementation"] or ""), megatron["adam_implementation"]
    assert_parity(megatron, fused)
    assert_not_slower(megatron, fused)
