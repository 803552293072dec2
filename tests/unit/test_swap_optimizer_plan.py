"""`npuspeed plan` and the adaptive memory policy know what --swap-optimizer frees (and costs):
on a device the states and masters between steps, minus the window the step holds; on the CPU
backend nothing."""
from __future__ import annotations

import pytest

from npuspeed.plan.planner import plan

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
         "--micro-batch-size", "2", "--bf16"]
CUDA = ["--npuspeed-device", "cuda"]


def _rank(argv):
    p = plan(MODEL + argv, with_removes=False)
    assert p.ok, p.problems
    return p, p.ranks[0]


def test_on_a_device_states_and_masters_leave_between_steps():
    _, base = _rank(CUDA)
    p, swap = _rank(CUDA + ["--swap-optimizer"])
    assert swap.optimizer == 0 and swap.masters == 0
    assert swap.swapped_optimizer == base.optimizer + base.masters > 0
    assert swap.peak < base.peak
    # the step holds at most the window: here the whole (tiny) state fits in one window
    assert swap.step_peak <= base.step_peak
    assert "pinned host memory" in dict(p.effects.summaries)["swap_optimizer"]


def test_the_window_bounds_what_the_step_holds():
    big = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "128",
           "--micro-batch-size", "1", "--bf16"]
    base = plan(big + CUDA, with_removes=False).ranks[0]
    chunk_mb = 4
    swap = plan(big + CUDA + ["--swap-optimizer", "--swap-optimizer-chunk-mb", str(chunk_mb)],
                with_removes=False).ranks[0]
    window = 3 * chunk_mb * 2**20
    full_step_state = base.optimizer + 4 * (base.masters // 4)  # full masters in the step
    assert swap.step_peak == base.step_peak - full_step_state + window


def test_with_reuse_fp32_param_only_the_states_move():
    _, reuse = _rank(CUDA + ["--reuse-fp32-param"])
    _, both = _rank(CUDA + ["--reuse-fp32-param", "--swap-optimizer"])
    assert both.masters == reuse.masters > 0  # the residual stays
    assert both.optimizer == 0 and both.swapped_optimizer == reuse.optimizer


def test_on_the_cpu_backend_the_states_stay_in_place():
    _, base = _rank([])
    p, swap = _rank(["--swap-optimizer"])
    assert (swap.optimizer, swap.masters, swap.swapped_optimizer, swap.step_peak, swap.peak) == \
        (base.optimizer, base.masters, 0, base.step_peak, base.peak)
    assert "stay in place" in dict(p.effects.summaries)["swap_optimizer"]
    assert swap_seconds_of(p) == 0.0


def swap_seconds_of(p):
    from npuspeed.plan.speed import swap_seconds

    return swap_seconds(p.run, optimizer_s=1.0)


def test_on_the_cpu_backend_the_forced_mechanics_free_nothing(monkeypatch):
    monkeypatch.setenv("NPUSPEED_SWAP_OPTIMIZER", "run")
    _, base = _rank([])
    p, swap = _rank(["--swap-optimizer"])
    assert (swap.optimizer, swap.masters, swap.swapped_optimizer) == (base.optimizer, base.masters, 0)
    assert "frees nothing" in dict(p.effects.summaries)["swap_optimizer"]
    # the host copies replace the states in the same memory; the chunks in flight come on top
    # (here the default 128 MiB chunks hold the whole tiny state)
    assert swap.step_peak == base.step_peak + base.optimizer + base.masters
    _, small = _rank(["--swap-optimizer", "--swap-optimizer-chunk-mb", "1"])
    assert small.step_peak == base.step_peak + 3 * 2**20
    assert swap.peak >= base.peak


def test_step_time_cost_per_backend(monkeypatch):
    monkeypatch.setenv("NPUSPEED_SWAP_OPTIMIZER", "run")  # the CPU row: the mechanics' copies
    from npuspeed.plan.speed import swap_seconds

    from npuspeed.accelerator.host_link import HOST_LINK_BYTES_PER_S

    link = HOST_LINK_BYTES_PER_S["cuda"]  # the one CUDA figure (was this file's own 20e9)
    p, _ = _rank(CUDA + ["--swap-optimizer"])
    moved = p.ranks[0].swapped_optimizer
    # hidden behind a long enough update: only the first chunk in and the last out remain
    assert swap_seconds(p.run, optimizer_s=10.0) == pytest.approx(2 * moved / link)
    assert swap_seconds(p.run, optimizer_s=0.0) == pytest.approx(3 * moved / link)
    cpu, _ = _rank(["--swap-optimizer"])
    assert swap_seconds(cpu.run, optimizer_s=10.0) == pytest.approx(2 * moved / 5e9)
    off, _ = _rank(CUDA)
    assert swap_seconds(off.run, optimizer_s=1.0) == 0.0


def _outcome(argv):
    from npuspeed.plan.adaptive import AdaptiveError, choose

    try:
        p = choose(argv, world=1)
    except AdaptiveError as exc:
        return "refused: " + str(exc).split(":")[1]
    return (p.full, p.activation, p.norm, p.selective, p.peak)


def test_adaptive_policy_counts_it_on_a_device_and_not_on_cpu(monkeypatch):
    from npuspeed.plan.adaptive import MARGIN

    _, base = _rank(CUDA)
    _, swap = _rank(CUDA + ["--swap-optimizer"])
    budget_mib = (swap.peak / (1 - MARGIN) + 2**20) / 2**20  # fits with the swap alone
    assert base.peak > budget_mib * 2**20 * (1 - MARGIN)  # but not without it
    argv = MODEL + CUDA + ["--adaptive-recompute-device-size", f"{budget_mib:.2f}"]
    with_swap, without = _outcome(argv + ["--swap-optimizer"]), _outcome(argv)
    assert with_swap[:4] == (0, 0, 0, False)  # no recompute needed
    assert without != with_swap  # recompute, or nothing fits at all
    # on the CPU backend the swap frees nothing: with small chunks the same policy as without it;
    # with chunks that hold the whole (tiny) state the step's peak grows and nothing fits
    _, cpu = _rank([])
    cpu_argv = MODEL + ["--adaptive-recompute-device-size", f"{cpu.peak / 2**20:.2f}"]
    plain = _outcome(cpu_argv)
    assert not isinstance(plain, str)
    assert _outcome(cpu_argv + ["--swap-optimizer"]) == plain  # by default the states stay in place
    monkeypatch.setenv("NPUSPEED_SWAP_OPTIMIZER", "run")
    assert _outcome(cpu_argv + ["--swap-optimizer", "--swap-optimizer-chunk-mb", "0.25"]) == plain
    assert _outcome(cpu_argv + ["--swap-optimizer"]).startswith("refused:  nothing fits")
