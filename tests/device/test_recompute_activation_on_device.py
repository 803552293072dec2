"""--recompute-activation-function on the accelerator: the MLP activation's storage is freed in
every layer and recomputed in backward, losses are bitwise the run without it under
--deterministic-mode (bitwise-equal gradients, as on CPU), and the forward/backward peak drops by
at least half of what one micro-batch frees (README: the activation output is not kept)."""
from __future__ import annotations

import pytest

from device_checks import assert_deterministic, assert_on_device, counters, layer_calls
from device_runs import DETERMINISTIC, ITERS, MICRO_BATCHES, MODEL, NO_DROPOUT, train

pytestmark = pytest.mark.device
COVERS = ("--recompute-activation-function", "--recompute-activation-function-num-layers")

FLAG = ["--recompute-activation-function"]


def test_recompute_activation(tmp_path_factory):
    base = train(tmp_path_factory, MODEL + NO_DROPOUT + DETERMINISTIC)
    run = train(tmp_path_factory, MODEL + NO_DROPOUT + DETERMINISTIC + FLAG)
    assert_on_device(base, run)
    assert_deterministic(base, run)
    c = counters(run, "recompute.")
    # every layer of every micro-batch: freed after fc2, recomputed before fc2's backward
    assert c.get("recompute.freed") == c.get("recompute.recomputed") == layer_calls(), c
    assert not c.get("recompute.kept_shared"), c
    assert not counters(base, "recompute."), base["npuspeed_counters"]
    assert run["losses"] == base["losses"]
    freed_per_micro_batch = c["recompute.freed_bytes"] / (ITERS * MICRO_BATCHES)
    saved = base["forward_backward_peak_bytes"] - run["forward_backward_peak_bytes"]
    assert saved >= freed_per_micro_batch / 2, (saved, freed_per_micro_batch)


def test_first_layer_only(tmp_path_factory):
    """--recompute-activation-function-num-layers 1: only the first layer recomputes (one module
    selected, its storage freed once per micro-batch), bitwise the same losses, a peak between."""
    base = train(tmp_path_factory, MODEL + NO_DROPOUT + DETERMINISTIC)
    every = train(tmp_path_factory, MODEL + NO_DROPOUT + DETERMINISTIC + FLAG)
    run = train(tmp_path_factory, MODEL + NO_DROPOUT + DETERMINISTIC + FLAG
                + ["--recompute-activation-function-num-layers", "1"])
    assert_on_device(run)
    assert_deterministic(run)
    c = counters(run, "recompute.")
    assert c.get("recompute.selected") == 1, c
    assert c.get("recompute.freed") == c.get("recompute.recomputed") == MICRO_BATCHES * ITERS, c
    assert run["losses"] == base["losses"]
    peak = run["forward_backward_peak_bytes"]
    assert every["forward_backward_peak_bytes"] <= peak <= base["forward_backward_peak_bytes"], (
        every["forward_backward_peak_bytes"], peak, base["forward_backward_peak_bytes"])
