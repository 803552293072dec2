"""--swap-optimizer on the accelerator: Adam's states and the fp32 masters (12 of the 16 bytes
a bf16 parameter keeps on the device) live in pinned host memory between steps and come in by
chunks during the step. README: bitwise-equal training (here under --deterministic-mode), the
device peak lower by at least 80% of the state bytes (the acceptance figure, here at the tier's
model with 16 MiB chunks), the device holds a window of chunks during the step, not the state.
Megatron's --optimizer-cpu-offload [--optimizer-offload-fraction F] needs Transformer Engine:
without it npuspeed refuses it in one line pointing to --swap-optimizer."""
from __future__ import annotations

import importlib.util

import pytest

from device_checks import assert_deterministic, assert_on_device, counters
from device_runs import DETERMINISTIC, ITERS, MODEL, NO_DROPOUT, ON_HOST, device_only, refused, train

pytestmark = pytest.mark.device
COVERS = ("--swap-optimizer", "--swap-optimizer-chunk-mb", "--swap-optimizer-mode", "--optimizer-cpu-offload", "--optimizer-offload-fraction")

ARGS = MODEL + NO_DROPOUT + DETERMINISTIC
#: the whole saving: every chunk moves (the default sizing keeps resident what would not hide)
FLAG = ["--swap-optimizer", "--swap-optimizer-mode", "whole"]
#: small enough for several chunks a step (the tier's model: about 550 MiB of states and masters)
CHUNK_MB = 0.25 if ON_HOST else 16


def _swapped(run: dict) -> dict:
    c = counters(run, "swap_optimizer.")
    assert c.get("swap_optimizer.steps") == ITERS, c
    assert c.get("swap_optimizer.chunks_in", 0) >= ITERS - 1 and c.get("swap_optimizer.chunks_out", 0) >= ITERS, c
    return c


def test_swap_optimizer(tmp_path_factory):
    base = train(tmp_path_factory, ARGS)
    run = train(tmp_path_factory, ARGS + FLAG)
    small = train(tmp_path_factory, ARGS + FLAG + ["--swap-optimizer-chunk-mb", str(CHUNK_MB)])
    assert_on_device(base, run, small)
    assert_deterministic(base, run, small)
    assert not counters(base, "swap_optimizer."), base["npuspeed_counters"]
    c, cs = _swapped(run), _swapped(small)
    assert run["losses"] == base["losses"] and small["losses"] == base["losses"]
    # base weight bytes: bf16 params (2 B) + fp32 masters (4 B); states and masters: 12 B a parameter
    state = 2 * base["weight_bytes"]
    # every step sends the states and masters out (plus the masters once after the optimizer is built)
    assert cs["swap_optimizer.bytes_out"] >= 0.99 * ITERS * state, (cs, state)
    assert cs["swap_optimizer.chunks_out"] / ITERS > c["swap_optimizer.chunks_out"] / ITERS >= 1, (cs, c)
    if not device_only("the device peak drops by the state bytes (the host copies live in the same memory)"):
        return
    # masters off the device: weight bytes are the bf16 parameters' alone
    assert run["weight_bytes"] <= base["weight_bytes"] / 3 * 1.01, (run["weight_bytes"], base["weight_bytes"])
    for r in (run, small):  # between steps the device holds neither states nor masters
        drop = base["forward_backward_peak_bytes"] - r["forward_backward_peak_bytes"]
        assert drop >= 0.8 * state, f"forward/backward peak {drop / 2**20:.0f} MiB lower, state {state / 2**20:.0f} MiB"
    drop = base["peak_mem_bytes"] - small["peak_mem_bytes"]
    assert drop >= 0.8 * state, f"device peak {drop / 2**20:.0f} MiB lower, state {state / 2**20:.0f} MiB"
    # the step holds a window of chunks, not the whole state
    step_drop = base["optimizer_step_peak_bytes"] - small["optimizer_step_peak_bytes"]
    assert step_drop >= 0.5 * state, f"optimizer step peak {step_drop / 2**20:.0f} MiB lower"


def test_optimizer_cpu_offload(tmp_path_factory):
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed: --optimizer-cpu-offload is Megatron-Core's own "
                    "HybridDeviceOptimizer (needs --use-precision-aware-optimizer); npuspeed leaves it alone")
    line = refused(tmp_path_factory, ARGS + ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"])
    assert "--optimizer-cpu-offload" in line and "--swap-optimizer" in line and "Transformer Engine" in line, line
    line = refused(tmp_path_factory, ARGS + ["--optimizer-offload-fraction", "0.5"])
    assert "--optimizer-offload-fraction is a setting of --optimizer-cpu-offload" in line, line
