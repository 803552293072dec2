"""--swap-attention in the planner and as a candidate of the adaptive policy (no device here:
the planning is tested, for a cuda backend named with `--npuspeed-device cuda`).

The replay: a tensor only a swapped module's ops save leaves the device after its last forward
reader and comes back when backward reaches its layer, with the layer below (prefetch).
`npuspeed plan`: on a device backend the swapped activations are subtracted, on CPU nothing
is. The policy: swap chosen where it is cheaper than recompute (long sequences: the copies
hide behind quadratic attention), never on CPU, and only with --adaptive-memory-optimization.
"""
from __future__ import annotations

import pytest

from npuspeed.plan.adaptive import MAIN, OPT, choose
from npuspeed.plan.graph import Graph, Op, replay
from npuspeed.plan.planner import plan

TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "512",
        "--micro-batch-size", "2", "--attention-dropout", "0", "--hidden-dropout", "0", "--nproc-per-node", "1"]
CUDA = ["--npuspeed-device", "cuda"]
#: long sequence, flash attention, bf16: a layer's forward is long enough to hide its copies
LONG = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "32768",
        "--max-position-embeddings", "32768", "--micro-batch-size", "1", "--global-batch-size", "1", "--bf16",
        "--use-flash-attn", "--attention-dropout", "0", "--hidden-dropout", "0", "--vocab-size", "1024",
        "--nproc-per-node", "1"]
MB = 2**20


def _two_layers(swap: bool) -> Graph:
    """x -> a0 (saved by layer 0's swapped op) -> a1 (layer 1's) -> y; 1 MiB each."""
    g = Graph(inputs={"x": MB})
    g.add(Op("l0.qkv.linear", ("x",), {"a0": MB}, saves=("x",), swap=0 if swap else -1))
    g.add(Op("l1.qkv.linear", ("a0",), {"a1": MB}, saves=("a0",), swap=1 if swap else -1))
    g.add(Op("l2.qkv.linear", ("a1",), {"y": MB}, saves=("a1",), swap=2 if swap else -1))
    return g


def test_replay_frees_swapped_saves_and_fetches_a_layer_ahead():
    kept, swapped = replay(_two_layers(False)), replay(_two_layers(True))
    assert kept.held == 2 * MB and swapped.held == 0  # a0, a1 (x is an input, not held)
    assert swapped.swapped == {1: MB, 2: MB}  # x is the graph's input: not this graph's to free
    # backward of layer 2 fetches a1 and, ahead, a0: both back, as when kept
    assert swapped.bwd_peak == kept.bwd_peak + 2 * MB  # above what each holds (0 vs 2 MiB)


def test_plan_subtracts_swapped_activations_on_a_device_only():
    on_cpu = plan(TINY + ["--swap-attention"])
    assert on_cpu.removes["swap_attention"] == 0 and on_cpu.ranks[0].swapped_per_microbatch == 0
    assert "the host is the device here" in dict(on_cpu.effects.summaries)["swap_attention"]
    plain = plan(TINY + CUDA, with_removes=False)
    got = plan(TINY + CUDA + ["--swap-attention"])
    rank = got.ranks[0]
    # the attention block's saves per layer (fp32): the norm output linear_qkv saves, the QKV
    # output (q, k, v views), the softmax output and the context linear_proj saves
    tokens, hidden, scores = 2 * 512, 64, 2 * 4 * 512 * 512
    per_layer = 4 * (tokens * hidden * (1 + 3 + 1) + scores)
    assert rank.swapped_per_layer == per_layer and rank.swapped_per_microbatch == 4 * per_layer
    # the peak is the top layer's backward: it and the layer fetched ahead are back on the device
    assert got.removes["swap_attention"] == plain.peak - got.peak == 2 * per_layer
    from npuspeed.plan import render

    assert "swapped to host memory (--swap-attention): 37.0 MiB a micro-batch, 9.2 MiB a layer" in render.text(got)
    assert "swapped to host" not in render.text(on_cpu)


def test_policy_prices_swap_with_the_swaps_own_sizing_and_link():
    """The policy prices a swap by the run's sizing rule (npuspeed/offload/sizing.py) over the
    link this process knows. At S 32768 on the nominal 25 GB/s cuda link the top layer's 385 MiB
    copies are exposed (nothing above it starts its fetch: ~32 ms against a 15 ms layer
    recompute), so recompute wins; with a link this process measured ten times faster (a fake
    here) the copies hide and the policy swaps, in the whole mode the budget needs."""
    from npuspeed.accelerator import host_link

    plain = plan(LONG + CUDA, with_removes=False).peak
    budget = f"{0.7 * plain / MB:.1f}"
    nominal = choose(LONG + CUDA + [MAIN, budget, OPT])
    assert not nominal.swap and "--swap-attention" not in nominal.flags()
    with host_link.fake(250e9):
        policy = choose(LONG + CUDA + [MAIN, budget, OPT])
    assert policy.swap and policy.peak <= 0.7 * plain * 0.95
    flags = policy.flags()
    assert flags[flags.index("--swap-attention"):][:3] == ["--swap-attention", "--swap-attention-mode", "whole"]
    assert "swap: attention block of the other" in policy.describe()
    assert plan(LONG + CUDA + policy.flags(), with_removes=False).peak == policy.peak  # the flags are the plan
    without_opt = choose(LONG + CUDA + [MAIN, budget])
    assert not without_opt.swap and f"swap: not considered (add {OPT})" in without_opt.describe()


@pytest.mark.parametrize("model", [TINY, LONG], ids=["tiny", "long-seq"])
def test_policy_never_picks_swap_on_cpu(model):
    plain = plan(model, with_removes=False).peak
    for frac in (0.65, 0.85):
        policy = choose(model + [MAIN, f"{frac * plain / MB:.1f}", OPT])
        assert not policy.swap and "--swap-attention" not in policy.flags()
        assert "not a candidate on the cpu backend: the host is the device" in policy.describe()


def test_the_policy_s_swap_passes_validation_a_user_s_does_not(npuspeed_runtime):
    from feature_ctx import ctx_for

    from npuspeed.features.adaptive_memory import AdaptiveMemoryFeature
    from npuspeed.features.base import FeatureError
    from npuspeed.features.swap_attention import SwapAttentionFeature

    chosen = ctx_for([MAIN, "60", "--adaptive-policy", "x", "--swap-attention", "--adaptive-swap"])
    AdaptiveMemoryFeature().validate(chosen)
    SwapAttentionFeature().validate(chosen)
    with pytest.raises(Exception, match="MindSpeed refuses"):
        choose(TINY + [MAIN, "60", "--swap-attention"])
    with pytest.raises(FeatureError, match="MindSpeed refuses"):
        SwapAttentionFeature().validate(ctx_for([MAIN, "60", "--adaptive-policy", "x", "--swap-attention"]))
