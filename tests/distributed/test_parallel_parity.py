"""Every parallel layout of the example matches the TP=1 run from the same initial weights.

fp32, dropout off, 8 iterations, at most 1e-5 absolute loss difference (issue 2).
"""
from __future__ import annotations

import pytest

from launch import LLAMA, MOE, NO_DROPOUT, TINY, max_abs_diff, run_example

ITERS = ["--train-iters", "8"]
TOL = 1e-5


@pytest.fixture(scope="module")
def gpt_tp1(tmp_path_factory):
    return run_example(TINY + NO_DROPOUT + ITERS, tmp_path_factory.mktemp("tp1"))


@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2"],
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ["--pipeline-model-parallel-size", "2"],
    ["--use-distributed-optimizer"],
], ids=["tp2", "tp2-sp", "pp2", "dp2-distopt"])
def test_gpt_layouts_match_tp1(gpt_tp1, layout, tmp_path):
    run = run_example(TINY + NO_DROPOUT + ITERS + layout, tmp_path, nproc=2)
    assert run["world_size"] == 2
    assert len(run["losses"]) == 8
    assert max_abs_diff(run["losses"], gpt_tp1["losses"]) <= TOL
    assert gpt_tp1["losses"][-1] < gpt_tp1["losses"][0]


def test_llama_tp2_sp_matches_tp1(tmp_path):
    base = run_example(TINY + NO_DROPOUT + ITERS + LLAMA, tmp_path, name="llama1")
    run = run_example(TINY + NO_DROPOUT + ITERS + LLAMA +
                      ["--tensor-model-parallel-size", "2", "--sequence-parallel"], tmp_path, nproc=2,
                      name="llama2")
    assert max_abs_diff(run["losses"], base["losses"]) <= TOL


def test_moe_ep2_matches_ep1(tmp_path):
    base = run_example(TINY + NO_DROPOUT + ITERS + MOE, tmp_path, name="moe1")
    run = run_example(TINY + NO_DROPOUT + ITERS + MOE + ["--expert-model-parallel-size", "2"],
                      tmp_path, nproc=2, name="moe2")
    assert max_abs_diff(run["losses"], base["losses"]) <= TOL
