"""--deterministic-mode on the accelerator: two identical runs (fused attention on the device's
kernel with a deterministic backward) give bitwise-equal losses and the summary says the mode was
in force (README: --deterministic-mode). --npuspeed-device: the flag overrides NPUSPEED_DEVICE in
the environment (here naming another backend) and the run lands on the accelerator, its losses
bitwise those of the run picked by the environment."""
from __future__ import annotations

import pytest

from device_checks import assert_deterministic, assert_on_device, attention_calls, layer_calls
from device_runs import ATTENTION_KERNEL, DETERMINISTIC, MODEL, NO_DROPOUT, ON_HOST, accelerator, train

pytestmark = pytest.mark.device
COVERS = ("--deterministic-mode", "--npuspeed-device")

ARGS = MODEL + NO_DROPOUT + DETERMINISTIC + ["--use-flash-attn"]
#: a second run of the same arguments, not the cached first (an env entry the example ignores)
AGAIN = {"NPUSPEED_DEVICE_TIER_REPEAT": "1"}


def test_two_runs_are_bitwise_equal(tmp_path_factory):
    first = train(tmp_path_factory, ARGS)
    second = train(tmp_path_factory, ARGS, env=AGAIN)
    plain = train(tmp_path_factory, MODEL + NO_DROPOUT + ["--use-flash-attn"])
    assert_on_device(first, second, plain)
    assert_deterministic(first, second)
    assert plain["deterministic_mode"] is False, "deterministic algorithms on without the flag"
    for run in (first, second):
        assert attention_calls(run) == {ATTENTION_KERNEL[accelerator()]: layer_calls()}, run["attention_calls"]
    assert second["losses"] == first["losses"], "two runs under --deterministic-mode differ"
    assert first["losses"][-1] < first["losses"][0], first["losses"]


def test_npuspeed_device_overrides_the_environment(tmp_path_factory):
    acc = accelerator()
    other = "cuda" if ON_HOST else "cpu"  # the harness check: a backend this host cannot run
    first = train(tmp_path_factory, ARGS)
    run = train(tmp_path_factory, ARGS + ["--npuspeed-device", acc], env={"NPUSPEED_DEVICE": other})
    assert_on_device(run)
    assert_deterministic(run)
    assert run["losses"] == first["losses"]
