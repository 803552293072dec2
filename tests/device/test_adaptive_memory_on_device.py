"""--adaptive-recompute-device-size MB [--adaptive-memory-optimization] on the accelerator under a
device memory budget of 80% of the plain run's measured peak: the policy (npuspeed sets
--adaptive-policy, and --adaptive-swap where it chose the swap) is in the summary, what it chose
ran (npuspeed's recompute and swap counters match its layer counts), the run's measured device
peak stays within the budget (README: every measured peak stayed under its budget), and the
losses agree with the plain run's (bf16 tolerance)."""
from __future__ import annotations

import re

import pytest

from device_checks import assert_on_device, assert_parity, counters
from device_runs import ITERS, LAYERS, MICRO_BATCHES, MODEL, NO_DROPOUT, ON_HOST, train

pytestmark = pytest.mark.device
COVERS = ("--adaptive-recompute-device-size", "--adaptive-memory-optimization", "--adaptive-policy",
          "--adaptive-swap")

ARGS = MODEL + NO_DROPOUT + ["--use-flash-attn"]
BUDGET = 0.8  # of the plain run's peak
POLICY = re.compile(r"of (\d+) layers per stage: full recompute (\d+), activation recompute (\d+), "
                    r"norm recompute (\d+)")


def _check_policy(run: dict, budget_bytes: float) -> str:
    policy = run["adaptive_policy"]
    assert policy, "no policy in the summary (--adaptive-policy unset)"
    layers, full, activation, norm = (int(x) for x in POLICY.match(policy).groups())
    assert layers == LAYERS and full + activation + norm > 0, policy  # under 80% something is recomputed
    assert counters(run, "recompute.").get("recompute.selected", 0) == activation, (policy, run["npuspeed_counters"])
    assert counters(run, "recompute_norm.").get("recompute_norm.selected", 0) == 2 * norm, policy
    swap = counters(run, "swap.")
    if "swap: attention block" in policy:  # --swap-attention --adaptive-swap: every layer's attention block
        # wrapped; a fully recomputed layer's forward runs without a graph (and its rerun is backward): no copy
        assert swap.get("swap.modules") == LAYERS, (policy, swap)
        assert swap.get("swap.groups") == (LAYERS - full) * MICRO_BATCHES * ITERS, (policy, swap)
        assert swap.get("swap.out_bytes", 0) > 0, (policy, swap)
    else:
        assert not swap, (policy, swap)
    assert run["peak_mem_bytes"] <= budget_bytes, (f"peak {run['peak_mem_bytes'] / 2**20:.1f} MiB above the "
                                                    f"budget {budget_bytes / 2**20:.1f} MiB: {policy}")
    return policy


@pytest.mark.parametrize("optimize", [False, True], ids=["recompute", "memory-optimization"])
def test_policy_fits_the_budget(tmp_path_factory, optimize):
    plain = train(tmp_path_factory, ARGS)
    budget = BUDGET * plain["peak_mem_bytes"]
    flags = ["--adaptive-recompute-device-size", f"{budget / 2**20:.3f}"]
    flags += ["--adaptive-memory-optimization"] if optimize else []
    env = {"NPUSPEED_CPU_MEMORY_LIMIT_MB": f"{budget / 2**20:.3f}"} if ON_HOST else {}  # the CPU's device size
    run = train(tmp_path_factory, ARGS + flags, env=env)
    assert_on_device(plain, run)
    assert plain["adaptive_policy"] is None
    policy = _check_policy(run, budget)
    if optimize and ON_HOST:
        assert "swap: not a candidate on the cpu backend" in policy, policy
    assert_parity(plain, run)
