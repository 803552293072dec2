"""npuspeed.compute_floor: the step's GEMM and attention calls against a count by hand and
against Megatron-LM's model FLOPs (npuspeed.throughput and the formula written out in
tests/megatron_flops_by_hand.py), and the floor timed on CPU at a tiny size."""
from __future__ import annotations

import pytest
import torch

from megatron_flops_by_hand import megatron_args, megatron_by_hand
from npuspeed import compute_floor, throughput
from npuspeed.compute_floor import calls, flops


def _model(**given):
    a = megatron_args(**given)
    return a, throughput.from_args(a)


def test_the_calls_of_a_small_model_by_hand():
    """2 layers, hidden 64, 4 heads in 2 groups (head dim 16), SwiGLU ffn 96, seq 32, vocab 128,
    micro-batch 2 (64 tokens), TP 2: per rank q = 32, k = v = 16 wide, fc1 2 x 48, fc2 48."""
    _, m = _model(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True,
                  num_query_groups=2, ffn_hidden_size=96, seq_length=32, padded_vocab_size=128, swiglu=True)
    got = {(c.layer, c.phase): (c.shape, c.count) for c in calls(m, micro_batch=2, tp=2)}
    assert got == {
        ("qkv", "fwd"): ((64, 64, 64), 2), ("qkv", "dgrad"): ((64, 64, 64), 2), ("qkv", "wgrad"): ((64, 64, 64), 2),
        ("proj", "fwd"): ((64, 64, 32), 2), ("proj", "dgrad"): ((64, 32, 64), 2), ("proj", "wgrad"): ((64, 32, 64), 2),
        ("fc1", "fwd"): ((64, 96, 64), 2), ("fc1", "dgrad"): ((64, 64, 96), 2), ("fc1", "wgrad"): ((96, 64, 64), 2),
        ("fc2", "fwd"): ((64, 64, 48), 2), ("fc2", "dgrad"): ((64, 48, 64), 2), ("fc2", "wgrad"): ((64, 48, 64), 2),
        ("logits", "fwd"): ((64, 64, 64), 1), ("logits", "dgrad"): ((64, 64, 64), 1),
        ("logits", "wgrad"): ((64, 64, 64), 1),
        ("core", "fwd+bwd"): ((2, 32, 2, 1, 16), 2),
    }
    # one fc1 forward: 2 x 64 tokens x 64 in x 96 out; the attention: 6 x 2 x 32^2 x 32 (causal, fwd + bwd)
    one = {(c.layer, c.phase): c.flops for c in calls(m, micro_batch=2, tp=2)}
    assert one[("fc1", "fwd")] == 2 * 64 * 64 * 96 and one[("core", "fwd+bwd")] == 6 * 2 * 32 * 32 * 32


LLAMA = dict(group_query_attention=True, num_query_groups=2, swiglu=True, ffn_hidden_size=176, padded_vocab_size=256)


@pytest.mark.parametrize("given,micro_batch,tp", [
    (LLAMA, 1, 1),
    (LLAMA, 2, 2),
    (dict(padded_vocab_size=512, seq_length=128, num_layers=3), 1, 4),
    (dict(padded_vocab_size=256, kv_channels=32, hidden_size=96, num_attention_heads=4), 4, 2),
])
def test_the_step_s_calls_are_megatron_s_model_flops(given, micro_batch, tp):
    a, m = _model(**given)
    global_batch, micro_batches = 8, 8 // micro_batch
    per_rank = flops(calls(m, micro_batch, tp)) * micro_batches
    assert per_rank * tp == throughput.model_flops(m, global_batch) == megatron_by_hand(a, global_batch)


def test_moe_and_uneven_splits_are_refused():
    _, m = _model(num_experts=4, padded_vocab_size=128)
    with pytest.raises(ValueError, match="MoE"):
        calls(m, 1, 1)
    _, m = _model(padded_vocab_size=130)
    with pytest.raises(ValueError, match="padded vocabulary 130 is not divisible by TP 4"):
        calls(m, 1, 4)


def test_the_floor_on_cpu_times_every_call_and_sums_them():
    _, m = _model(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True,
                  num_query_groups=2, ffn_hidden_size=96, seq_length=32, padded_vocab_size=128, swiglu=True)
    got = compute_floor.floor(m, micro_batch=1, micro_batches=3, tp=1, device="cpu", synchronize=lambda: None,
                              dtype=torch.float32, dropout_p=0.1, peak_tflops=1.0, repeats=2)
    rows = got["calls"]
    assert len(rows) == 16 and all(r["median_ms"] > 0 for r in rows)
    total = sum(r["median_ms"] * r["count"] for r in rows) * 3
    assert got["floor_ms"] == pytest.approx(total)
    assert got["ms_by_kind"]["gemm"] + got["ms_by_kind"]["attention"] == pytest.approx(total)
    assert got["flops_per_rank"] == flops(calls(m, 1, 1)) * 3
    assert got["mfu"] == pytest.approx(got["tflops"])  # against a peak of 1 TFLOP/s
    attention = [r for r in rows if r["kind"] == "attention"][0]
    assert attention["kernel"] in ("npuspeed_flash_fp32", "sdpa")
