"""TFLOP/s and MFU: the model-FLOPs count against Megatron-LM's formula evaluated by hand, the
peak table, the example's log segment and summary keys (dense GQA SwiGLU, MoE with a shared
expert, CP2), `npuspeed report --measure-peak` and the planner's predicted TFLOP/s."""
from __future__ import annotations

import argparse
import json
import os
import sys

import pytest

from megatron_flops_by_hand import megatron_by_hand
from npuspeed import throughput
from npuspeed.throughput import model_flops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)


def _args(**over):
    base = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, group_query_attention=True,
                num_query_groups=2, kv_channels=16, seq_length=64, padded_vocab_size=256, swiglu=True,
                num_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None,
                moe_shared_expert_intermediate_size=None, moe_layer_freq=1)
    base.update(over)
    return argparse.Namespace(**base)


def test_dense_gqa_swiglu_matches_megatron_by_hand():
    a = _args()
    # on paper, per token and layer: qkv 64 x (64 + 32 + 32) = 8192, scores and values 64 x 64 / 2 x 2
    # = 4096, out 64 x 64 = 4096, SwiGLU MLP 64 x 128 x 3 = 24576; 2 layers + logits 64 x 256:
    # 6 x (2 x 40960 + 16384) = 589824 per token, x 4 sequences x 64 tokens
    assert model_flops(throughput.from_args(a), 4) == megatron_by_hand(a, 4) == 589824 * 256
    # GQA and SwiGLU each change the count (the test is not blind to either)
    assert model_flops(throughput.from_args(_args(group_query_attention=False)), 4) > megatron_by_hand(a, 4)
    assert model_flops(throughput.from_args(_args(swiglu=False)), 4) == megatron_by_hand(_args(swiglu=False), 4)
    assert model_flops(throughput.from_args(_args(swiglu=False)), 4) < megatron_by_hand(a, 4)


def test_moe_with_shared_expert_matches_megatron_by_hand():
    a = _args(group_query_attention=False, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
              moe_shared_expert_intermediate_size=48)
    # per token and layer: attention 64 x 192 + 4096 + 4096 = 20480; experts 64 x 3 x (2 x 32 + 48) =
    # 21504; 6 x (2 x 41984 + 16384) = 602112 per token
    assert model_flops(throughput.from_args(a), 4) == megatron_by_hand(a, 4) == 602112 * 256
    no_shared = _args(**{**vars(a), "moe_shared_expert_intermediate_size": None})
    assert model_flops(throughput.from_args(no_shared), 4) == megatron_by_hand(no_shared, 4)
    assert megatron_by_hand(no_shared, 4) < megatron_by_hand(a, 4)


@pytest.mark.parametrize("freq", [2, [0, 1, 1, 0]])
def test_moe_layer_frequency_counts_dense_layers_as_dense(freq):
    a = _args(num_layers=4, num_experts=8, moe_router_topk=1, moe_ffn_hidden_size=48,
              moe_shared_expert_intermediate_size=16, moe_layer_freq=freq)
    assert model_flops(throughput.from_args(a), 2) == megatron_by_hand(a, 2)
    assert throughput.from_args(a).moe_layers() == 2


def test_rates_divide_by_world_and_peak():
    assert throughput.tflops_per_rank(2e12, 1000.0, 1) == pytest.approx(2.0)
    assert throughput.tflops_per_rank(2e12, 500.0, 2) == pytest.approx(2.0)
    assert throughput.mfu(2.0, 8.0) == 0.25 and throughput.mfu(2.0, None) is None


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("Ascend910B3", 313.0), ("x86_64", None), ("", None)])
def test_peak_table(name, peak):
    assert throughput.peak_tflops(name) == peak


# -- the example's log segment and summary keys ------------------------------------------------
def _example_args(argv, world, monkeypatch):
    from gpt_example.args import parse_args
    from gpt_example.model import padded_vocab_size

    monkeypatch.setenv("WORLD_SIZE", str(world))
    args = parse_args(argv)
    dp = world // (args.tensor_model_parallel_size * args.context_parallel_size)
    args.global_batch_size = args.global_batch_size or args.micro_batch_size * dp
    args.padded_vocab_size = padded_vocab_size(258, args)
    return args


def _as_megatron_lm(args):
    """What Megatron-LM's validate_args fills in before it counts: kv_channels, moe_layer_freq."""
    return argparse.Namespace(**{**vars(args), "kv_channels": args.kv_channels or args.hidden_size // args.num_attention_heads,
                                 "moe_layer_freq": getattr(args, "moe_layer_freq", 1)})


def test_example_summary_dense_cp2_and_moe_shared(monkeypatch):
    from gpt_example import throughput as ex

    llama = ["--group-query-attention", "--num-query-groups", "2", "--swiglu", "--global-batch-size", "4",
             "--device-peak-tflops", "0.5"]
    cp1 = _example_args(llama, 1, monkeypatch)
    cp2 = _example_args(llama + ["--use-flash-attn", "--context-parallel-size", "2"], 2, monkeypatch)
    moe = _example_args(llama + ["--num-experts", "4", "--moe-shared-expert-intermediate-size", "96"], 1, monkeypatch)
    for args, world in ((cp1, 1), (cp2, 2), (moe, 1)):
        s = ex.summary_keys(args, 40.0, world, "x86_64")
        hand = megatron_by_hand(_as_megatron_lm(args), 4)
        assert s["model_flops_per_iteration"] == hand
        assert s["tflops_per_s_per_rank"] == pytest.approx(hand / 0.040 / world / 1e12, rel=1e-12)
        assert s["device_peak_tflops"] == 0.5 and s["mfu"] == pytest.approx(s["tflops_per_s_per_rank"] / 0.5)
    # CP splits the sequence, not the model FLOPs of the global batch; per rank they are halved
    assert ex.iteration_flops(cp2) == ex.iteration_flops(cp1)
    assert ex.summary_keys(cp2, 40.0, 2, None)["tflops_per_s_per_rank"] == pytest.approx(
        ex.summary_keys(cp1, 40.0, 1, None)["tflops_per_s_per_rank"] / 2)
    assert ex.iteration_flops(moe) > ex.iteration_flops(cp1)  # top-2 experts and the shared one


def test_example_peak_defaults_to_the_table_and_log_segment_needs_the_flag(monkeypatch):
    from gpt_example import throughput as ex

    args = _example_args([], 1, monkeypatch)
    s = ex.summary_keys(args, 10.0, 1, "x86_64")
    assert s["device_peak_tflops"] is None and s["mfu"] is None and s["tflops_per_s_per_rank"] > 0
    assert ex.summary_keys(args, 10.0, 1, "NVIDIA H100 80GB HBM3")["device_peak_tflops"] == 989.0
    assert ex.log_segment(args, 10.0, 1) == ""
    args = _example_args(["--log-throughput"], 1, monkeypatch)
    seg = ex.log_segment(args, 10.0, 1)
    value = float(seg.split(":")[1].strip(" |"))
    assert seg.startswith(" throughput per GPU (TFLOP/s/GPU): ") and seg.endswith(" |")
    assert value == pytest.approx(ex.iteration_flops(args) / 0.010 / 1e12, rel=1e-3)


# -- npuspeed report --measure-peak -------------------------------------------------------------
def test_measure_gemm_tflops_times_the_gemm():
    import torch

    found = throughput.measure_gemm_tflops("cpu", lambda: None, n=128, seconds=0.05)
    assert found["n"] == 128 and found["dtype"] == "bfloat16" and found["repeats"] >= 3
    assert found["tflops"] >= found["median_tflops"] > 0
    fp32 = throughput.measure_gemm_tflops("cpu", lambda: None, n=64, dtype=torch.float32, seconds=0.0)
    assert fp32["dtype"] == "float32" and fp32["repeats"] == 3


def test_report_measure_peak_json(npuspeed_runtime, capsys, monkeypatch):
    from npuspeed import cli, reporting

    calls = []
    real = reporting.measure_gemm_tflops

    def small(*a, **kw):  # the CLI's path, at a size that takes milliseconds in a unit test
        calls.append(kw)
        return real(*a, **{**kw, "n": 256, "seconds": 0.05})

    monkeypatch.setattr(reporting, "measure_gemm_tflops", small)
    assert cli.main(["report", "--json", "--measure-peak"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert calls and data["measured_peak"]["n"] == 256 and data["measured_peak"]["dtype"] == "bfloat16"
    assert data["measured_peak_tflops"] == data["measured_peak"]["tflops"] > 0
    assert data["device_peak_tflops"] is None  # CPU: no table entry
    assert cli.main(["report"]) == 0
    text = capsys.readouterr().out
    assert "bf16 dense peak (table): none for this device" in text and "--measure-peak" in text
    plain = reporting.collect()
    assert plain["measured_peak_tflops"] is None and plain["measured_peak"] is None


# -- npuspeed plan --------------------------------------------------------------------------------
def test_plan_predicts_tflops_beside_the_step_time():
    from test_plan_speed import MODEL, profile

    from npuspeed.plan import render
    from npuspeed.plan.planner import plan

    p = plan([*MODEL, "--swiglu", "--group-query-attention", "--num-query-groups", "2", "--nproc-per-node", "2"],
             profile=profile(), with_removes=False)
    assert p.ok, p.problems
    m = p.spec.model
    hand = megatron_by_hand(argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden, ffn_hidden_size=m.ffn, num_attention_heads=m.heads,
        group_query_attention=True, num_query_groups=2, kv_channels=m.kv_channels, seq_length=m.seq_length,
        padded_vocab_size=m.padded_vocab(1), swiglu=True, num_experts=None, moe_ffn_hidden_size=None,
        moe_shared_expert_intermediate_size=None), 4)
    assert p.speed.tflops_per_s_per_rank == pytest.approx(hand / (p.speed.step_ms / 1e3) / 2 / 1e12)
    out = render.as_json(p)
    assert out["tflops_per_s_per_rank"] == p.speed.tflops_per_s_per_rank
    assert "TFLOP/s per rank" in render.text(p)
