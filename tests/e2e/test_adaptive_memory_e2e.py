"""--adaptive-recompute-device-size on the CPU backend, whose NPUSPEED_CPU_MEMORY_LIMIT_MB makes
the tracking allocator refuse allocations past a limit as a device of that size would.

CI: with the limit at 80% of a plain run's measured peak, the plain run fails with the
out-of-memory error and the adaptive run given that budget trains to the end within it, its
losses bit-identical to the plain run's (fp32, dropout 0: recompute changes no value); and
`npuspeed plan` shows the policy without training. Slow (`make bench`): five budgets between
the all-recompute peak and the plain peak, each run under its own limit, never above it, its
per-step CPU time against the fastest hand-picked setting of the recompute flags that fits
(interleaved rounds, each setting's fastest step; never wall time, which other work on the host moves).
"""
from __future__ import annotations

import os
import statistics
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


#: rounds of interleaved runs (each run: 12 iterations, the first left out)
ROUNDS = int(os.environ.get("NPUSPEED_ADAPTIVE_ROUNDS", "5"))


@pytest.mark.slow
@pytest.mark.timeout(3600)  # 14 runs a round: about 4 minutes a round on this loaded host
def test_five_budgets_within_the_limit_and_near_the_best_hand_picked(tmp_path):
    """Step time is rank 0's process CPU time per step (on this shared host wall time moves
    3-5x with other work; CPU time less, but it too grows under contention, up to +40% seen):
    the policy's runs and the hand-picked ones interleaved in rounds, each setting's fastest step
    over all its rounds asserted within 10% of the fastest fitting hand-picked setting's
    (contention only adds time, so the fastest step is what the setting costs; the median of the
    per-round ratios of each run's fastest step moved 10% with the same flags: printed, not
    asserted)."""
    runs = RUN[:-1] + ["12"]
    hand = {i: [] for i in range(len(HAND))}
    for i, h in enumerate(HAND):  # round 0 of the hand-picked settings: their (deterministic) peaks
        hand[i].append(run_example(runs + h, tmp_path, name=f"hand{i}"))
    peaks = [hand[i][0]["peak_mem_bytes"] for i in range(len(HAND))]
    plain, lowest = peaks[0], min(peaks)
    budgets = [lowest + (plain - lowest) * (k + 0.5) / 5 for k in range(5)]
    adaptive = {k: [] for k in range(5)}

    def policy_run(k):
        adaptive[k].append(run_example(runs + [FLAG, f"{budgets[k] / 2**20:.3f}"], tmp_path, name=f"adaptive{k}",
                                       env=_limit(budgets[k] / 2**20)))

    for k in range(5):
        policy_run(k)
    for r in range(1, ROUNDS):  # then hand-picked and policy runs alternate, in a rotated order
        order = [("h", i) for i in range(len(HAND))]
        for k in range(5):
            order.insert(2 * k + 1, ("a", k))
        shift = r * 3 % len(order)
        for kind, i in order[shift:] + order[:shift]:
            if kind == "h":
                hand[i].append(run_example(runs + HAND[i], tmp_path, name=f"hand{i}"))
            else:
                policy_run(i)
    cpu = lambda rows: [min(row["step_cpu_ms"][1:]) for row in rows]  # noqa: E731
    cpu_median = lambda rows: [row["median_step_cpu_ms"] for row in rows]  # noqa: E731
    wall = lambda rows: [row["median_step_ms"] for row in rows]  # noqa: E731
    failures = []
    for k, budget in enumerate(budgets):
        got = adaptive[k]
        assert all(row["peak_mem_bytes"] <= budget for row in got), [row["peak_mem_bytes"] for row in got]
        fits = [i for i in range(len(HAND)) if peaks[i] <= budget]
        best = min(fits, key=lambda i: statistics.median(cpu(hand[i])))
        ratios = [a / h for a, h in zip(cpu(got), cpu(hand[best]))]
        fastest = min(cpu(got)) / min(cpu(hand[best]))
        policy = [line for line in got[0]["log"].splitlines() if "adaptive memory policy" in line][0]
        print(f"budget {budget / 2**20:.1f} MiB: policy {policy.split('flags: ')[-1]} at "
              f"{got[0]['peak_mem_bytes'] / 2**20:.1f} MiB: CPU ms/step fastest {_spread(cpu(got))}, median "
              f"{_spread(cpu_median(got))}, wall median {_spread(wall(got))}; "
              f"best hand-picked that fits: {' '.join(HAND[best]) or '(none)'} at {peaks[best] / 2**20:.1f} MiB: "
              f"CPU fastest {_spread(cpu(hand[best]))}, median {_spread(cpu_median(hand[best]))}, wall median "
              f"{_spread(wall(hand[best]))}; CPU ratio per round "
              f"{', '.join(f'{x:.3f}' for x in ratios)} (median {statistics.median(ratios):.3f}); fastest step over "
              f"all rounds {min(cpu(got)):.1f} / {min(cpu(hand[best])):.1f} = {fastest:.3f}; load "
              f"{os.getloadavg()[0]:.1f}", flush=True)
        if fastest > 1.10:
            failures.append(f"budget {budget / 2**20:.1f} MiB: fastest step {fastest:.3f} of the best hand-picked's")
    for i, h in enumerate(HAND):
        print(f"hand {' '.join(h) or '(none)'}: {peaks[i] / 2**20:.1f} MiB, CPU fastest {_spread(cpu(hand[i]))}, "
              f"median {_spread(cpu_median(hand[i]))}, wall median {_spread(wall(hand[i]))}", flush=True)
    assert not failures, failures


def _spread(values) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


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
