"""--log-throughput on the accelerator: the summary's TFLOP/s per rank is Megatron-LM's model
FLOPs (its num_floating_point_operations, evaluated here by hand from the tier's model) over the
measured mean step (the steps after the first), every log line carries Megatron-LM's segment from
that line's own step time, and MFU is TFLOP/s over the device's peak (README: TFLOP/s and MFU)."""
from __future__ import annotations

import re
import statistics

import pytest

from device_checks import assert_on_device
from device_runs import FFN, GLOBAL, GROUPS, HEADS, HIDDEN, ITERS, LAYERS, MODEL, NO_DROPOUT, SEQ, VOCAB, train
from megatron_flops_by_hand import megatron_args, megatron_by_hand

pytestmark = pytest.mark.device
COVERS = ("--log-throughput",)

SEGMENT = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+) \| throughput per GPU \(TFLOP/s/GPU\): "
                     r"([\d.e-]+) \|")


def test_tflops_equal_the_formula_over_the_measured_step(tmp_path_factory):
    run = train(tmp_path_factory, MODEL + NO_DROPOUT + ["--log-throughput"])
    assert_on_device(run)
    padded = -(-VOCAB // 128) * 128  # the example's --make-vocab-size-divisible-by 128, TP 1
    hand = megatron_by_hand(megatron_args(num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN,
                                          num_attention_heads=HEADS, group_query_attention=True,
                                          num_query_groups=GROUPS, seq_length=SEQ, padded_vocab_size=padded,
                                          swiglu=True), GLOBAL)
    assert run["model_flops_per_iteration"] == hand
    assert run["mean_step_ms"] == pytest.approx(statistics.mean(run["step_ms"][1:]), rel=1e-9)
    tflops = hand / (run["mean_step_ms"] / 1e3) / run["world_size"] / 1e12
    assert run["tflops_per_s_per_rank"] == pytest.approx(tflops, rel=1e-6)
    peak = run["device_peak_tflops"]
    assert run["mfu"] == (None if peak is None else pytest.approx(tflops / peak, rel=1e-6)), (run["mfu"], peak)
    lines = SEGMENT.findall(run["log"])
    assert len(lines) == ITERS, run["log"][-3000:]
    for ms, value in lines:  # printed rounded: 0.1 ms, and 0.1 TFLOP/s (4 digits below 1)
        assert float(value) == pytest.approx(hand / (float(ms) / 1e3) / 1e12, rel=0.01, abs=0.06)
    print(f"{run['tflops_per_s_per_rank']:.4g} TFLOP/s per rank, mfu {run['mfu']}, {run['tokens_per_s']:.0f} tokens/s")
