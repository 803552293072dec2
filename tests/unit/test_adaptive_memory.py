"""The adaptive memory policy chosen by the planner (npuspeed/plan/adaptive.py): under the
budget with its margin, cheaper as the budget grows, a clear error naming the smallest budget
that fits, and refusals of flags it owns or MindSpeed refuses with it."""
from __future__ import annotations

import re

import pytest

from npuspeed.plan.adaptive import MAIN, MARGIN, OPT, AdaptiveError, choose, expand
from npuspeed.plan.planner import plan

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "512",
         "--micro-batch-size", "2", "--attention-dropout", "0", "--nproc-per-node", "1"]


def _mib(x):
    return x / 2**20


def test_policies_fit_their_budget_and_cost_less_as_it_grows():
    plain = plan(MODEL, with_removes=False).peak
    assert choose(MODEL + [MAIN, f"{_mib(plain) * 1.1:.3f}"]).flags() == []  # room: keep everything
    costs = []
    for frac in (0.6, 0.7, 0.8, 0.9):
        budget = plain * frac
        p = choose(MODEL + [MAIN, f"{_mib(budget):.3f}"])
        assert p.peak <= budget * (1 - MARGIN)
        assert plan(MODEL + p.flags(), with_removes=False).peak == p.peak  # the flags are the plan
        assert p.flags(), frac
        costs.append(p.cost)
    assert costs == sorted(costs, reverse=True), costs


def test_nothing_fits_names_the_smallest_budget_that_does():
    with pytest.raises(AdaptiveError, match=r"nothing fits.*give at least") as err:
        choose(MODEL + [MAIN, "10"])
    need = float(re.search(r"give at least ([0-9.]+)", str(err.value)).group(1))
    assert "\n" not in str(err.value)
    choose(MODEL + [MAIN, f"{need + 0.1:.1f}"])  # that budget does fit


@pytest.mark.parametrize("extra, message", [
    (["--recompute-norm"], "chooses recompute itself: drop --recompute-norm"),
    (["--recompute-granularity", "full"], "drop --recompute-granularity"),
    (["--swap-attention"], "MindSpeed refuses"),
])
def test_flags_it_owns_or_refuses(extra, message):
    with pytest.raises(AdaptiveError, match=message):
        choose(MODEL + [MAIN, "100"] + extra)


def test_expand_adds_the_policy_and_alone_the_option_is_an_error():
    argv, policy = expand(MODEL + [MAIN, "60"])
    assert argv[len(MODEL) + 2:] == policy.flags() + ["--adaptive-policy", policy.describe()]
    assert expand(MODEL) == (MODEL, None)
    with pytest.raises(AdaptiveError, match=f"{OPT} is given without {MAIN}"):
        expand(MODEL + [OPT])


def test_feature_refuses_swap_with_adaptive(npuspeed_runtime):
    from feature_ctx import ctx_for

    from npuspeed.features.adaptive_memory import AdaptiveMemoryFeature
    from npuspeed.features.base import FeatureError
    from npuspeed.features.swap_attention import SwapAttentionFeature

    ctx = ctx_for([MAIN, "60", "--adaptive-policy", "x", "--swap-attention"])
    for feature in (AdaptiveMemoryFeature(), SwapAttentionFeature()):
        with pytest.raises(FeatureError, match="MindSpeed refuses"):
            feature.validate(ctx)


def test_cost_prices_the_memory_bound_core_attention_by_its_bytes():
    """The roofline (npuspeed/plan/recompute_cost.py) against the FLOPs proxy it replaced: the
    unfused core attention is a few passes over b x heads x S x S, so its recompute costs more
    of a layer's than its FLOPs share. Measured on this CPU host (README model, interleaved
    CPU-time medians): selective recompute of 4 layers costs about what full recompute of 2-3
    layers does, where the FLOPs proxy put it under 2."""
    from npuspeed.plan.planner import PlannedDevice
    from npuspeed.plan.recompute_cost import _matmul_flops, layer_costs
    from npuspeed.plan.dims import dims

    p = plan(MODEL, with_removes=False)
    d = dims(p.spec)
    flops_share = _matmul_flops(d, p.spec.model, "core", "unfused") / _matmul_flops(d, p.spec.model, "layer", "unfused")
    c = layer_costs(p.run, PlannedDevice("cpu"))
    assert c.core / c.full > flops_share + 0.05  # 0.68 against 0.57 (the old proxy: 0.46)
    assert 2 * c.full < 4 * c.core < 3 * c.full
    assert c.act < 0.05 * c.full and c.norm < 0.05 * c.full  # a few elementwise passes at these sizes
    flash = plan(MODEL + ["--use-flash-attn"], with_removes=False)
    assert layer_costs(flash.run, PlannedDevice("cpu")).core == 0.0  # selective leaves a fused kernel alone
