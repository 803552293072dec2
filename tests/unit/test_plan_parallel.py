"""`npuspeed plan` for context parallelism and MoE/EP: what the CP and MoE features' plan
effects change (nothing is run; tests/e2e/test_plan_memory.py compares with measured runs)."""
from __future__ import annotations

import pytest

from npuspeed.plan.planner import plan

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
         "--micro-batch-size", "2", "--use-flash-attn"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]


def _plan(*flags, nproc=2):
    p = plan([*MODEL, *flags, "--nproc-per-node", str(nproc)], with_removes=False)
    assert p.ok, p.problems
    return p


@pytest.mark.parametrize("algo,extra,u,r", [
    ("megatron_cp_algo", [], 1, 4), ("ulysses_cp_algo", [], 4, 1),
    ("hybrid_cp_algo", ["--ulysses-degree-in-cp", "2"], 2, 2)])
def test_cp_plan_effect_states_the_algorithm_and_halves_activations(algo, extra, u, r):
    cp = _plan("--context-parallel-size", "4", "--context-parallel-algo", algo, *extra, nproc=4)
    assert cp.effects.variants["core_attention"] == "cp"
    assert cp.effects.options == {"cp_ulysses": u, "cp_ring": r}
    assert "context_parallel" in cp.effects.features and cp.comm["cp"] > 0
    one = _plan(nproc=4)  # the same world as DP 4: every rank the whole sequence
    assert cp.ranks[0].activation_per_microbatch[0] < one.ranks[0].activation_per_microbatch[0] / 3


def test_cp_ring_sends_kv_and_fp32_dkv_ulysses_sends_less_at_two_ranks():
    ring = _plan("--context-parallel-size", "2")
    uly = _plan("--context-parallel-size", "2", "--context-parallel-algo", "ulysses_cp_algo")
    # per layer and micro-batch: tokens 256 (b 2 x s/2 128), 4 heads of 64, fp32
    q = 256 * 4 * 64 * 4
    kv = 2 * q
    assert ring.comm["cp"] == pytest.approx(4 * 1 * (2 * kv + 2 * kv))  # 4 layers: K/V twice, dK/dV twice
    assert uly.comm["cp"] == pytest.approx(4 * 2 * 0.5 * (q + kv + q))
    assert uly.comm["cp"] < ring.comm["cp"]


def test_cp_shards_the_distributed_optimizer_over_dp_x_cp():
    cp = _plan("--context-parallel-size", "2", "--use-distributed-optimizer", "--bf16")
    plain = _plan("--context-parallel-size", "2", "--bf16")
    assert cp.ranks[0].optimizer == pytest.approx(plain.ranks[0].optimizer / 2, rel=0.01)


def test_fused_attention_hands_cp_calls_over():
    from npuspeed.features.fused_attention import FusedAttentionFeature
    from npuspeed.plan.context import context_for

    p = _plan("--context-parallel-size", "2")
    ctx = context_for(MODEL + ["--context-parallel-size", "2"])[0]
    assert FusedAttentionFeature().plan_effect(p.spec, ctx) is None


def test_moe_experts_split_over_ep_and_send_all_to_alls():
    ep1 = _plan(*MOE)
    ep2 = _plan(*MOE, "--expert-model-parallel-size", "2")
    assert ep1.comm.get("ep", 0) == 0 and ep2.comm["ep"] > 0
    # 4 layers x 4 experts x (fc1 + fc2 of 256 x 1024) fp32 on one rank, half of them at EP 2
    experts = 4 * 4 * 2 * 256 * 1024 * 4
    assert ep1.ranks[0].params - ep2.ranks[0].params == pytest.approx(experts / 2, rel=0.01)
    assert ep2.ranks[0].activation_terms["moe"] == ep1.ranks[0].activation_terms["moe"]


def test_moe_feature_effects():
    grouped = _plan(*MOE, "--expert-model-parallel-size", "2", "--moe-grouped-gemm", "--swiglu", "--bf16")
    assert grouped.effects.options["moe_grouped"] is True
    seq = _plan(*MOE, "--expert-model-parallel-size", "2", "--swiglu", "--bf16")
    assert grouped.ranks[0].activation_terms["moe"] < seq.ranks[0].activation_terms["moe"]  # fused SwiGLU x prob
    ext = _plan(*MOE, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-tp-extend-ep")
    assert ext.effects.options == {"moe_ep": 2, "moe_etp": 1}
    overlap = _plan(*MOE, "--expert-model-parallel-size", "2", "--moe-alltoall-overlap-comm")
    assert overlap.effects.overlap["ep"] == pytest.approx(0.5)


def test_moe_what_is_not_modeled_is_said():
    p = plan([*MODEL, *MOE, "--moe-expert-capacity-factor", "1.0", "--nproc-per-node", "1"], with_removes=False)
    assert not p.ok and any("capacity" in x for x in p.problems)


def test_moe_with_tp_needs_sp_and_the_calibration_times_only_shapes_that_train():
    """Megatron-Core's MoELayer refuses to train with TP > 1 and no SP (EP or not): the plan
    lists it, and --calibrate does not time that group shape (it crashed there)."""
    from npuspeed.plan.calibrate import groups
    from npuspeed.plan.speed import group_key

    p = plan([*MODEL, *MOE, "--tensor-model-parallel-size", "2", "--nproc-per-node", "2"], with_removes=False)
    assert not p.ok and any("--sequence-parallel" in x for x in p.problems)
    ok = _plan(*MOE, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-tp-extend-ep")
    assert set(groups(ok.spec, 2)) == {group_key(1, False), group_key(2, True)}


def test_a_plan_resolves_its_run_once(monkeypatch):
    """The expert layout and the per-rank sizes are derived once per resolved run (run.py), and
    memory, communication and speed read them: a model that derives them again is caught here."""
    import sys

    from npuspeed.plan import dims as dims_mod, run as run_mod

    calls = {"expert_layout": 0, "dims": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    originals = (("expert_layout", run_mod.expert_layout), ("dims", dims_mod.dims))
    for module in [m for n, m in list(sys.modules.items()) if n.startswith("npuspeed.plan")]:
        for name, fn in originals:
            if getattr(module, name, None) is fn:  # every planner module's binding of them
                monkeypatch.setattr(module, name, counted(name, fn))
    from test_plan_speed import profile

    p = plan([*MODEL, *MOE, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-tp-extend-ep",
              "--nproc-per-node", "2", "--bf16"], with_removes=False, profile=profile())
    assert p.ok and p.speed is not None and p.run.experts == (2, 1, 1)
    assert calls == {"expert_layout": 1, "dims": 1}
    p = plan([*MODEL, *MOE, "--expert-model-parallel-size", "2", "--nproc-per-node", "2"])
    assert calls["expert_layout"] == calls["dims"] == 2 + len(p.removes)  # once per resolved run
