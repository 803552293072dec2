"""--swap-optimizer through the example: losses bitwise equal to the run without it, and a
checkpoint saved with the flag resumes bitwise with and without it (and the other way round).

Each run checks the swap really ran (its counters: every step in and out by chunks, bytes in
equal to bytes out after the first step). A small chunk cuts the tiny model into several chunks.
"""
from __future__ import annotations

import pytest

from launch import TINY, run_example

ITERS = 8
#: whole: every chunk moves every step (the default sizing keeps them resident on the CPU after
#: the measured step: copies there run in order with compute)
FLAG = ["--swap-optimizer", "--swap-optimizer-chunk-mb", "0.01", "--swap-optimizer-mode", "whole"]
#: on the CPU backend the states stay in place unless the mechanics are asked for
RUN = {"NPUSPEED_SWAP_OPTIMIZER": "run"}
LAYOUTS = {
    "tp1-fp32": (1, []),
    "tp1-bf16": (1, ["--bf16"]),
    "dp2-distopt-fp32": (2, ["--use-distributed-optimizer"]),
    "dp2-distopt-bf16": (2, ["--bf16", "--use-distributed-optimizer"]),
}


def _swapped(run: dict, steps: int) -> None:
    counters = run["npuspeed_counters"]
    assert counters["swap_optimizer.steps"] >= steps, counters
    assert counters["swap_optimizer.chunks_in"] >= 2 * (steps - 1), counters  # several chunks a step
    assert "--swap-optimizer: the host is the device on the cpu backend" in run["log"]
    assert "NPUSPEED_SWAP_OPTIMIZER=run: the mechanics run" in run["log"]


# CI keeps the suite short (the unit tests compare every optimizer kind bitwise in one process,
# and test_checkpoint_with_flag_resumes_without_it below runs DP2 with the distributed optimizer
# in CI); the four layouts' 8-iteration pairs run with `make bench` (-m slow).
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_bitwise_equal_to_the_run_without_it(layout, tmp_path):
    nproc, extra = LAYOUTS[layout]
    args = TINY + extra + ["--train-iters", str(ITERS)]
    base = run_example(args, tmp_path, nproc=nproc, name="base")
    swap = run_example(args + FLAG, tmp_path, nproc=nproc, name="swap", env=RUN)
    _swapped(swap, ITERS)
    assert swap["losses"] == base["losses"]


@pytest.mark.slow  # CI time: tests/unit/test_swap_optimizer.py round-trips the state dict bitwise in CI
def test_checkpoint_with_flag_resumes_without_it(tmp_path):
    """DP2, distributed optimizer, bf16: a run with the flag saves at 4; a run without it resumes
    there and its iterations 5-8 are the flagged run's, bit for bit (so the checkpoint held the
    real states and masters, not the empty device tensors)."""
    args = TINY + ["--bf16", "--use-distributed-optimizer", "--train-iters", str(ITERS)]
    ckpt = tmp_path / "ckpt"
    full = run_example(args + FLAG + ["--save", str(ckpt), "--save-interval", "4"], tmp_path, nproc=2, name="full",
                       env=RUN)
    _swapped(full, ITERS)
    resumed = run_example(args + ["--load", str(ckpt), "--ckpt-step", "4"], tmp_path, nproc=2, name="plain")
    assert resumed["first_iteration"] == 5
    assert resumed["losses"] == full["losses"][4:]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--bf16"], ["--bf16", "--use-distributed-optimizer"]],
                         ids=["fp32", "bf16", "bf16-distopt"])
def test_checkpoint_resumes_with_the_flag_both_ways(extra, tmp_path):
    nproc = 2 if "--use-distributed-optimizer" in extra else 1
    args = TINY + extra + ["--train-iters", str(ITERS)]
    for save_flag, load_flag in ((FLAG, FLAG), ([], FLAG), (FLAG, [])):
        ckpt = tmp_path / f"ckpt{len(save_flag)}{len(load_flag)}"
        full = run_example(args + save_flag + ["--save", str(ckpt), "--save-interval", "4"], tmp_path, nproc=nproc,
                           name="full", env=RUN)
        resumed = run_example(args + load_flag + ["--load", str(ckpt), "--ckpt-step", "4"], tmp_path,
                              nproc=nproc, name="resumed", env=RUN)
        assert resumed["losses"] == full["losses"][4:], (save_flag, load_flag)
        if load_flag:
            _swapped(resumed, ITERS - 4)
