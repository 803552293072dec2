"""--use-flash-attn on the accelerator against Megatron's unfused attention on the same device:
causal, with attention dropout 0.1, and over packed documents (with and without dropout).

Memory claim (README): no S x S tensor. Megatron's unfused path keeps at least the bf16
probabilities [b, heads, S, S] of every layer for backward, so the fused run's forward/backward
peak must be lower by at least half of that.
"""
from __future__ import annotations

import pytest

from device_checks import (
    assert_not_slower, assert_on_device, assert_parity, assert_sxs_saved, attention_calls, layer_calls,
)
from device_runs import (
    ATTENTION_KERNEL, DOCUMENT_KERNEL, DOCUMENTS, MODEL, NO_DROPOUT, BF16_TOL, accelerator, train,
)
from launch import max_abs_diff

pytestmark = pytest.mark.device
COVERS = ("--use-flash-attn",)

FLAG = ["--use-flash-attn"]
ATTENTION_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0.1"]


def assert_fused_kernel_ran(base: dict, run: dict, kernel: str) -> None:
    assert attention_calls(run) == {kernel: layer_calls()}, run["attention_calls"]
    assert attention_calls(base) == {}, base["attention_calls"]


def test_causal(tmp_path_factory):
    base = train(tmp_path_factory, MODEL + NO_DROPOUT)
    run = train(tmp_path_factory, MODEL + NO_DROPOUT + FLAG)
    assert_on_device(base, run)
    assert_fused_kernel_ran(base, run, ATTENTION_KERNEL[accelerator()])
    last = run["attention_last"]
    assert last["causal"] is True and last["dropout_p"] == 0.0 and last["dtype"] == "torch.bfloat16", last
    assert_parity(base, run)
    assert_sxs_saved(base, run)
    assert_not_slower(base, run)


def test_attention_dropout(tmp_path_factory):
    """The fused kernel draws its own dropout masks, so the two runs differ by construction: the
    gap to the unfused run with dropout must stay within twice what dropout itself moves the
    unfused run (dropout 0.1 vs 0), plus the bf16 tolerance."""
    base = train(tmp_path_factory, MODEL + ATTENTION_DROPOUT)
    run = train(tmp_path_factory, MODEL + ATTENTION_DROPOUT + FLAG)
    no_dropout = train(tmp_path_factory, MODEL + NO_DROPOUT)
    assert_on_device(base, run)
    assert_fused_kernel_ran(base, run, ATTENTION_KERNEL[accelerator()])
    last = run["attention_last"]
    assert last["dropout_p"] == pytest.approx(0.1) and last["causal"] is True, last
    dropout_moves = max_abs_diff(base["losses"], no_dropout["losses"])
    assert_parity(base, run, tol=2 * dropout_moves + BF16_TOL)
    assert_sxs_saved(base, run)
    assert_not_slower(base, run)


@pytest.mark.parametrize("dropout", ["0", "0.1"])
def test_packed_documents(tmp_path_factory, dropout):
    """Documents reach the fused path as PackedSeqParams (no S x S mask); the unfused run builds
    Megatron's S x S document mask on the device. At CP 1 dropout is drawn per call by the device
    kernel (compared as in test_attention_dropout)."""
    drop = ["--hidden-dropout", "0", "--attention-dropout", dropout]
    base = train(tmp_path_factory, MODEL + DOCUMENTS + drop)
    run = train(tmp_path_factory, MODEL + DOCUMENTS + drop + FLAG)
    assert_on_device(base, run)
    kernel = DOCUMENT_KERNEL[accelerator()]
    assert_fused_kernel_ran(base, run, kernel)
    reason = run["attention_calls"]["reasons"][kernel]
    assert "packed documents" in reason, reason
    tol = BF16_TOL
    if dropout != "0":
        no_dropout = train(tmp_path_factory, MODEL + DOCUMENTS + NO_DROPOUT)
        tol += 2 * max_abs_diff(base["losses"], no_dropout["losses"])
    assert_parity(base, run, tol=tol)
    assert_sxs_saved(base, run)
    assert_not_slower(base, run)
