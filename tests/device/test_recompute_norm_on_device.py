"""--recompute-norm [--recompute-norm-num-layers N] on the accelerator: the input and pre-MLP
norms' outputs are freed once linear_qkv / linear_fc1 used them and recomputed before their
backward. README: bit-identical losses (fused RMSNorm, as the CPU tier's TP2 pair; here under
--deterministic-mode, so both runs take the same kernel), and the forward/backward peak drops
by the two tokens x hidden outputs of every layer (asserted: at least half of what one
micro-batch frees, and what it frees at least those outputs)."""
from __future__ import annotations

import pytest

from device_checks import assert_deterministic, assert_on_device, counters, layer_calls
from device_runs import DETERMINISTIC, HIDDEN, ITERS, LAYERS, MICRO, MICRO_BATCHES, MODEL, NO_DROPOUT, SEQ, train

pytestmark = pytest.mark.device
COVERS = ("--recompute-norm", "--recompute-norm-num-layers")

ARGS = MODEL + NO_DROPOUT + DETERMINISTIC + ["--use-fused-rmsnorm"]
FLAG = ["--recompute-norm"]


def test_recompute_norm(tmp_path_factory):
    base = train(tmp_path_factory, ARGS)
    run = train(tmp_path_factory, ARGS + FLAG)
    assert_on_device(base, run)
    assert_deterministic(base, run)
    c = counters(run, "recompute_norm.")
    assert c.get("recompute_norm.selected") == 2 * LAYERS, c
    assert c.get("recompute_norm.freed") == c.get("recompute_norm.recomputed") == 2 * layer_calls(), c
    assert not counters(base, "recompute_norm."), base["npuspeed_counters"]
    assert run["losses"] == base["losses"]
    freed_per_micro_batch = c["recompute_norm.freed_bytes"] / (ITERS * MICRO_BATCHES)
    outputs = LAYERS * 2 * MICRO * SEQ * HIDDEN * 2  # bf16 [s, b, h] of two norms a layer
    assert freed_per_micro_batch >= outputs, (freed_per_micro_batch, outputs)
    saved = base["forward_backward_peak_bytes"] - run["forward_backward_peak_bytes"]
    assert saved >= freed_per_micro_batch / 2, (saved, freed_per_micro_batch)


def test_first_layer_only(tmp_path_factory):
    base = train(tmp_path_factory, ARGS)
    every = train(tmp_path_factory, ARGS + FLAG)
    run = train(tmp_path_factory, ARGS + FLAG + ["--recompute-norm-num-layers", "1"])
    assert_on_device(run)
    assert_deterministic(run)
    c = counters(run, "recompute_norm.")
    assert c.get("recompute_norm.selected") == 2, c
    assert c.get("recompute_norm.freed") == c.get("recompute_norm.recomputed") == 2 * MICRO_BATCHES * ITERS, c
    assert run["losses"] == base["losses"]
    peak = run["forward_backward_peak_bytes"]
    assert every["forward_backward_peak_bytes"] <= peak <= base["forward_backward_peak_bytes"], (
        every["forward_backward_peak_bytes"], peak, base["forward_backward_peak_bytes"])
