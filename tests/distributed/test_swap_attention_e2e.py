"""The example with and without --swap-attention: identical losses, bit for bit, over 8
iterations (fp32, dropout 0). On the CPU backend the host is the device: the log says the swap
saves nothing there; the memory gain is measured on an accelerator.

CI: TP1 with --use-flash-attn and --recompute-norm (the swap composes); TP2 + sequence
parallel and PP2 (1F1B, micro-batches in flight) run with `make bench` (-m slow).
"""
from __future__ import annotations

import pytest

from launch import NO_DROPOUT, TINY, run_example

#: `whole`: every layer's copies run on the CPU too (the default sizing swaps nothing where copies
#: cannot hide: tests/unit/test_swap_attention.py)
FLAG = ["--swap-attention", "--swap-attention-mode", "whole"]
BASE = TINY + NO_DROPOUT + ["--num-layers", "4", "--train-iters", "8", "--seq-length", "128"]


def _pair(tmp_path, args, nproc, name, flag=FLAG):
    base = run_example(args, tmp_path, nproc=nproc, name=f"{name}_base")
    got = run_example(args + flag, tmp_path, nproc=nproc, name=f"{name}_flag")
    assert "swap_attention" in got["log"] and "the host is the device" in got["log"]
    assert len(got["losses"]) == len(base["losses"]) == 8
    assert got["losses"] == base["losses"]
    return base, got


def test_tp1_flash_with_norm_recompute(tmp_path):
    _pair(tmp_path, BASE + ["--use-flash-attn", "--recompute-norm"], 1, "tp1")


@pytest.mark.slow  # the swap's mechanics are layout-blind (unit tests); CI time goes to TP1
def test_tp2_sp(tmp_path):
    _pair(tmp_path, BASE + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, "tp2sp")


@pytest.mark.slow
def test_pp2(tmp_path):
    _pair(tmp_path, BASE + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"], 2, "pp2")
