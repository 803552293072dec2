"""The example's TFLOP/s and MFU (--log-throughput, --device-peak-tflops): a dense GQA SwiGLU run
whose summary and log lines equal Megatron-LM's formula evaluated by hand from the run's own step
times (the 2-rank case is the README example's run, tests/e2e/test_example.py; CP2 and MoE with a
shared expert: tests/unit/test_throughput.py on the summary function itself)."""
from __future__ import annotations

import re

import pytest
from launch import LLAMA, TINY, run_example
from megatron_flops_by_hand import megatron_args, megatron_by_hand


def test_gqa_swiglu_tflops_and_mfu_equal_megatron_formula(tmp_path):
    peak = 0.05
    run = run_example(TINY + LLAMA + ["--train-iters", "4", "--log-throughput", "--device-peak-tflops", str(peak)],
                      tmp_path, nproc=1)
    # TINY: 4 sequences of 64 tokens a step, vocabulary 258 padded to a multiple of 1
    hand = megatron_by_hand(megatron_args(swiglu=True, group_query_attention=True, num_query_groups=2,
                                          padded_vocab_size=258), 4)
    assert run["model_flops_per_iteration"] == hand
    from_step = hand / (run["mean_step_ms"] / 1e3) / run["world_size"] / 1e12
    from_tokens = hand / (4 * 64) * run["tokens_per_s"] / run["world_size"] / 1e12
    assert run["tflops_per_s_per_rank"] == pytest.approx(from_step, rel=0.01)
    assert run["tflops_per_s_per_rank"] == pytest.approx(from_tokens, rel=0.01)
    assert run["device_peak_tflops"] == peak and run["mfu"] == pytest.approx(run["tflops_per_s_per_rank"] / peak)
    # every log line: Megatron-LM's segment, from that line's own step time (printed rounded)
    lines = re.findall(r"elapsed time per iteration \(ms\): ([\d.]+) \| throughput per GPU \(TFLOP/s/GPU\): "
                       r"([\d.e-]+) \|", run["log"])
    assert len(lines) == 4, run["log"][-3000:]
    for ms, tflops in lines:
        assert float(tflops) == pytest.approx(hand / (float(ms) / 1e3) / 1e12, rel=0.01)
    print(f"measured: {run['tflops_per_s_per_rank']:.4g} TFLOP/s per rank, mfu {run['mfu']:.3f} of {peak}, "
          f"{run['tokens_per_s']:.0f} tokens/s")
