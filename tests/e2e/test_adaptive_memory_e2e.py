"""--adaptive-recompute-device-size on the CPU backend, whose NPUSPEED_CPU_MEMORY_LIMIT_MB makes
the tracking allocator refuse allocations past a limit as a device of that size would.

CI: with the limit at 80% of a plain run's measured peak, the plain run fails with the
out-of-memory error and the adaptive run given that budget trains to the end within it, its
losses bit-identical to the plain run's (fp32, dropout 0: recompute changes no value); and
`npuspeed plan` shows the policy without training. Slow (`make bench`): five budgets between
the all-recompute peak and the plain peak, each run under its own limit, never above it, its
median step time against the fastest hand-picked setting of the recompute flags that fits.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from launch import ROOT, run_example

MODEL = ["--use-cpu-initialization", "--log-interval", "1", "--num-layers", "4", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "512", "--micro-batch-size", "2",
         "--attention-dropout", "0", "--hidden-dropout", "0"]
RUN = MODEL + ["--train-iters", "3"]
FLAG = "--adaptive-recompute-device-size"


def _limit(mib: float) -> dict:
    return {"NPUSPEED_CPU_MEMORY_LIMIT_MB": f"{mib:.3f}"}


def test_80_percent_of_the_plain_peak_plain_fails_adaptive_trains(tmp_path):
    plain = run_example(RUN, tmp_path, name="plain")
    budget = 0.8 * plain["peak_mem_bytes"] / 2**20
    with pytest.raises(AssertionError) as failed:
        run_example(RUN, tmp_path, name="plain_capped", env=_limit(budget))
    assert "OutOfMemoryError" in str(failed.value) and "npuspeed CPU memory limit" in str(failed.value)
    got = run_example(RUN + [FLAG, f"{budget:.3f}"], tmp_path, name="adaptive", env=_limit(budget))
    assert got["peak_mem_bytes"] <= budget * 2**20
    assert got["losses"] == plain["losses"]
    assert "npuspeed: adaptive memory policy:" in got["log"]
    assert got["adaptive_policy"].startswith("of 4 layers per stage") and plain["adaptive_policy"] is None


def test_plan_shows_the_policy_and_refuses_a_budget_too_small():
    cmd = [sys.executable, "-m", "npuspeed.cli", "plan", *MODEL, "--nproc-per-node", "1"]
    ok = subprocess.run(cmd + [FLAG, "66"], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0 and "adaptive memory policy: of 4 layers per stage" in ok.stdout
    bad = subprocess.run(cmd + [FLAG, "20"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "nothing fits" in bad.stderr and "give at least" in bad.stderr


HAND = [[], ["--recompute-norm"], ["--recompute-activation-function"],
        ["--recompute-norm", "--recompute-activation-function"]] + [
    ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(n)]
    for n in (1, 2, 3, 4)] + [["--recompute-granularity", "selective"]]


@pytest.mark.slow
def test_five_budgets_within_the_limit_and_near_the_best_hand_picked(tmp_path):
    runs = RUN[:-1] + ["6"]  # 6 iterations: median step times over 5
    hand = [run_example(runs + h, tmp_path, name=f"hand{i}") for i, h in enumerate(HAND)]
    plain, lowest = hand[0]["peak_mem_bytes"], min(h["peak_mem_bytes"] for h in hand)
    for k in range(5):
        budget = lowest + (plain - lowest) * (k + 0.5) / 5
        got = run_example(runs + [FLAG, f"{budget / 2**20:.3f}"], tmp_path, name=f"adaptive{k}",
                          env=_limit(budget / 2**20))
        assert got["peak_mem_bytes"] <= budget
        fits = [(h["median_step_ms"], " ".join(f) or "(none)") for h, f in zip(hand, HAND) if h["peak_mem_bytes"] <= budget]
        policy = [line for line in got["log"].splitlines() if "adaptive memory policy" in line][0]
        print(f"budget {budget / 2**20:.1f} MiB: adaptive {got['median_step_ms']:.1f} ms at "
              f"{got['peak_mem_bytes'] / 2**20:.1f} MiB ({policy.split('flags: ')[-1]}); best hand-picked that fits "
              f"{min(fits)[0]:.1f} ms ({min(fits)[1]})", flush=True)
        assert got["median_step_ms"] <= 1.10 * min(fits)[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                    ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]],
                         ids=["tp2-sp", "pp2"])
def test_parity_at_tp2_sp_and_pp2(tmp_path, layout):
    """8 fp32 iterations, dropout 0: the policy's recompute changes no loss bit."""
    from npuspeed.plan.planner import plan

    runs = MODEL + layout + ["--train-iters", "8"]
    budget = 0.85 * plan(runs + ["--nproc-per-node", "2"], with_removes=False).peak / 2**20
    plain = run_example(runs, tmp_path, nproc=2, name="plain")
    got = run_example(runs + [FLAG, f"{budget:.3f}"], tmp_path, nproc=2, name="adaptive")
    assert "flags: --recompute" in got["log"]  # something was chosen
    assert got["losses"] == plain["losses"]
