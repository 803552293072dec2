"""A NaN/Inf loss or gradient is reported with its iteration. With Megatron's check on
(--check-for-nan-in-loss-and-grad, the default, as Megatron-LM) a bf16/fp32 run stops before
the step reaches the weights; fp16's loss scaler skips the step and training goes on; with the
check off the run goes on and says so every iteration. One process each (fault_runner).
"""
from __future__ import annotations

import json
from pathlib import Path

import ranks
from launch import TINY

RUNNER = Path(__file__).with_name("_fault_runner.py")
ARGS = TINY + ["--train-iters", "5", "--save-interval", "2"]  # 2 micro-batches per iteration


def _run(fault: str, tmp_path, extra=()) -> tuple[ranks.Rank, dict | None]:
    summary = tmp_path / "summary.json"
    args = ARGS + ["--save", str(tmp_path / "ckpt"), "--summary-json", str(summary), *extra]
    (rank,) = ranks.wait(ranks.start(RUNNER, args, 1, env={"NPUSPEED_TEST_FAULT": fault}), 300)
    return rank, json.loads(summary.read_text()) if summary.exists() else None


def _one_error(rank) -> str:
    assert rank.rc == 1 and "Traceback" not in rank.err, rank.err[-3000:]
    lines = [line for line in rank.err.splitlines() if line.startswith("npuspeed: error: ")]
    assert len(lines) == 1, rank.err[-3000:]
    return lines[0]


def test_nan_loss_stops_before_the_step(tmp_path):
    rank, summary = _run("nan-at:5", tmp_path)  # iteration 3
    line = _one_error(rank)
    assert line.startswith("npuspeed: error: rank 0: iteration 3: found NaN in local forward loss calculation; "
                           "the step was not applied (--check-for-nan-in-loss-and-grad)")
    assert line.endswith(f"the last complete checkpoint is iteration 2 in {tmp_path / 'ckpt'}: restart with "
                         f"--load {tmp_path / 'ckpt'}")
    assert summary is None


def test_nan_gradient_stops_before_the_step(tmp_path):
    rank, _ = _run("nangrad-at:5", tmp_path)
    line = _one_error(rank)
    assert line.startswith("npuspeed: error: rank 0: iteration 3: found NaN in local grad norm for bucket #0 in "
                           "backward pass before data-parallel communication collective; the step was not applied")


def test_check_off_reports_every_nonfinite_iteration(tmp_path):
    rank, summary = _run("nan-at:5", tmp_path, ["--no-check-for-nan-in-loss-and-grad"])
    assert rank.rc == 0, rank.err[-3000:]
    assert "WARNING: iteration 3: lm loss is nan; grad norm is nan" in rank.out
    assert summary["nonfinite_iterations"][0] == 3 and all(x == x for x in summary["losses"][:2])


def test_fp16_loss_scaler_skips_the_step(tmp_path):
    rank, summary = _run("nan-at:5", tmp_path, ["--fp16"])
    assert rank.rc == 0, rank.err[-3000:]
    assert "WARNING: iteration 3: lm loss is nan; gradients are not finite: step skipped, loss scale now" in rank.out
    assert 3 in summary["nonfinite_iterations"] and summary["skipped_iterations"] >= 1
    assert all(x == x for x in summary["losses"][3:])  # the weights never saw the NaN
