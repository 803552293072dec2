"""--swap-attention [--swap-modules LIST] on the accelerator: the activations saved inside the
chosen modules go to pinned host memory in forward and come back one layer ahead in backward.
README: losses bit for bit (here under --deterministic-mode), every byte copied out comes back,
the top layer is fetched on demand and the others ahead; on a device the forward/backward peak
holds the layer in backward and the one being fetched, so it drops by (layers - 2) layers'
swapped bytes (asserted: at least half of that)."""
from __future__ import annotations

import pytest

from device_checks import assert_deterministic, assert_on_device, counters, layer_calls
from device_runs import DETERMINISTIC, ITERS, LAYERS, MICRO_BATCHES, MODEL, NO_DROPOUT, device_only, train

pytestmark = pytest.mark.device
COVERS = ("--swap-attention", "--swap-modules", "--swap-attention-mode")

ARGS = MODEL + NO_DROPOUT + DETERMINISTIC + ["--use-flash-attn"]
#: the whole saving: every layer swaps (the default sizing swaps what the link hides, which
#: depends on the device; the mechanics and the peak drop are checked with all of it)
FLAG = ["--swap-attention", "--swap-attention-mode", "whole"]


def _swapped(run: dict, modules: int) -> dict:
    c = counters(run, "swap.")
    assert c.get("swap.modules") == modules * LAYERS, c
    assert c.get("swap.groups") == modules * layer_calls(), c
    assert c.get("swap.out_bytes", 0) > 0 and c.get("swap.out_bytes") == c.get("swap.in_bytes"), c
    # each micro-batch's top layer is fetched when backward reaches it, every other one ahead
    assert c.get("swap.on_demand", 0) >= MICRO_BATCHES * ITERS and c.get("swap.prefetched", 0) > 0, c
    assert c["swap.on_demand"] + c["swap.prefetched"] == c["swap.groups"], c
    return c


def test_swap_attention(tmp_path_factory):
    base = train(tmp_path_factory, ARGS)
    run = train(tmp_path_factory, ARGS + FLAG)
    assert_on_device(base, run)
    assert_deterministic(base, run)
    assert not counters(base, "swap."), base["npuspeed_counters"]
    c = _swapped(run, 1)
    assert run["losses"] == base["losses"]
    if device_only("the forward/backward peak drops (the host is the device: nothing leaves it)"):
        per_layer = c["swap.out_bytes"] / c["swap.groups"]
        drop = base["forward_backward_peak_bytes"] - run["forward_backward_peak_bytes"]
        assert drop >= (LAYERS - 2) * per_layer / 2, (f"peak {drop / 2**20:.1f} MiB lower, a layer swaps "
                                                      f"{per_layer / 2**20:.1f} MiB")


def test_swap_modules(tmp_path_factory):
    base = train(tmp_path_factory, ARGS)
    default = train(tmp_path_factory, ARGS + FLAG)
    run = train(tmp_path_factory, ARGS + FLAG + ["--swap-modules", "core_attention,mlp"])
    assert_on_device(run)
    assert_deterministic(run)
    c = _swapped(run, 2)
    assert c["swap.out_bytes"] != counters(default, "swap.")["swap.out_bytes"], c
    assert run["losses"] == base["losses"]
    if device_only("the forward/backward peak drops (the host is the device: nothing leaves it)"):
        assert run["forward_backward_peak_bytes"] < base["forward_backward_peak_bytes"], (
            run["forward_backward_peak_bytes"], base["forward_backward_peak_bytes"])
