"""`npuspeed plan --schedules-method dualpipev`: the V placement (rank 0 holds the embedding and
the head), DualPipeV's order simulated (no deadlock, every op once, its bubble against DeepSeek's
formula) and walked for memory, and the printed plan (a model, not a measurement)."""
from __future__ import annotations

import json

import pytest

from npuspeed.features.moe_fb_overlap.plan import pairs_of
from npuspeed.features.pipeline import v_order as order
from npuspeed.plan import cli, schedule
from npuspeed.plan.placement import Placement
from npuspeed.plan.planner import plan
from test_plan_speed import profile

V = "dualpipev"
MODEL = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
         "--micro-batch-size", "1", "--bf16", "--pipeline-model-parallel-size", "2",
         "--num-layers-per-virtual-pipeline-stage", "2", "--untie-embeddings-and-output-weights",
         "--nproc-per-node", "2"]
FLAG = ["--schedules-method", "dualpipev"]


def _plan(*flags, gbs=8, prof=None):
    p = plan([*MODEL, "--global-batch-size", str(gbs), *flags], profile=prof, with_removes=False)
    assert p.ok, p.problems
    return p


def test_the_v_places_both_ends_on_rank_0():
    v, megatron = Placement(4, 2, V), Placement(4, 2)
    assert [v.stage(r, c) for r in range(4) for c in range(2)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert v.first(0, 0) and v.last(0, 1) and not v.last(3, 1) and not v.first(3, 0)
    assert megatron.first(0, 0) and megatron.last(3, 1) and not megatron.last(0, 1)
    with pytest.raises(ValueError, match="2 chunks"):
        Placement(4, 1, V)


@pytest.mark.parametrize("p", range(2, 9))
def test_the_v_never_deadlocks_and_runs_every_op_once(p):
    for m in range(2 * p, 2 * p + 6):
        _, done = schedule.timeline(p, 2, m, [[1.0, 1.0]] * p, [[1.0, 1.0]] * p, 0.1, V)
        assert sorted(done) == sorted((k, r, mb, c) for k in "FB" for r in range(p) for mb in range(m)
                                      for c in range(2))
        events = [schedule.events(p, r, 2, m, V) for r in range(p)]
        assert all(ev.count(("F", c)) == ev.count(("B", c)) == m for ev in events for c in range(2))


@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0)])
@pytest.mark.parametrize("p", range(2, 9))
def test_the_v_bubble_is_deepseeks(p, f, b):
    """Makespan less a rank's busy time (2m forwards and backwards of a chunk) is DeepSeek's
    (P-1)(F&B + B - 3W) with W = 0 and a paired step's F&B = F + B (no overlap priced here).
    Megatron's interleaved schedule on the same ranks and chunks leaves (P-1)(F + B): without
    the pair's overlap the V leaves (P-1) x B more."""
    for m in (2 * p, 2 * p + 3):
        makespan = schedule.simulate(p, 2, m, [[f, f]] * p, [[b, b]] * p, 0.0, V)
        assert makespan - 2 * m * (f + b) == pytest.approx((p - 1) * ((f + b) + b))
    m = 4 * p  # a multiple of P, as the interleaved schedule needs
    interleaved = schedule.simulate(p, 2, m, [[f, f]] * p, [[b, b]] * p, 0.0)
    assert interleaved - 2 * m * (f + b) == pytest.approx((p - 1) * (f + b))


@pytest.mark.parametrize("p", range(2, 7))
def test_moe_fb_overlap_counts_the_pairs_order_py_runs_on_rank_0(p):
    """--moe-fb-overlap's pairs_of (interleaved warm-up at 2 chunks) equals the V's paired steps
    on rank 0, 2(m - 2P + 1) + (P - 1), for every micro-batch count the V takes."""
    for m in range(2 * p, 2 * p + 6):
        paired = sum(op.paired for _, op in order.schedule(p, 0, m))
        assert paired == 2 * (m - 2 * p + 1) + (p - 1) == pairs_of(m, p, 2)[0]


def test_rank_0_holds_the_head_under_the_v():
    v, megatron = _plan(*FLAG), _plan()
    assert v.run.placement.v and not megatron.run.placement.v
    assert v.run.stages[0][1].head > 0 and v.run.stages[0][0].embedding > 0
    assert v.run.stages[1][1].head == 0 and megatron.run.stages[1][1].head > 0
    assert v.ranks[0].params > megatron.ranks[0].params and v.ranks[1].params < megatron.ranks[1].params
    assert v.ranks[0].params + v.ranks[1].params == megatron.ranks[0].params + megatron.ranks[1].params
    assert "head" in v.ranks[0].activation_terms and "head" not in v.ranks[1].activation_terms


def test_the_v_walks_order_py_for_memory():
    """Rank 0's in-flight count is the V's (forwards held at once along order.py, a paired step
    running its backward first), not the interleaved schedule's."""
    v, megatron = _plan(*FLAG), _plan()
    assert v.ranks[0].in_flight == schedule.max_in_flight(2, 0, 2, 8, V) == 4
    assert megatron.ranks[0].in_flight == schedule.max_in_flight(2, 0, 2, 8) == 5
    assert schedule.max_in_flight(2, 0, 2, 8, V, taking_turns=True) == 5  # both halves of a pair alive


def test_the_v_time_is_its_own_prediction():
    prof = profile()
    v, megatron = _plan(*FLAG, prof=prof).speed, _plan(prof=prof).speed
    assert v.step_ms != pytest.approx(megatron.step_ms) and v.bubble_ms != pytest.approx(megatron.bubble_ms)
    assert v.compute_ms == pytest.approx(megatron.compute_ms, rel=0.5)


def test_plan_prints_the_v(capsys):
    argv = [*MODEL, "--global-batch-size", "8"]
    cli.main(argv)
    without = capsys.readouterr().out
    cli.main(argv + FLAG)
    with_v = capsys.readouterr().out
    assert "(DualPipeV)" in with_v and "(interleaved 1F1B)" in without
    assert "dualpipev" in with_v and "V placement" in with_v and "(P-1)(F&B + B - 3W)" in with_v
    rows = [[ln for ln in out.splitlines() if ln.lstrip().startswith(("0 ", "1 "))] for out in (without, with_v)]
    assert rows[0] != rows[1]  # rank 0 holds the head: other parameters, other peak
    cli.main(argv + FLAG + ["--json"])
    assert json.loads(capsys.readouterr().out)["layout"]["schedule"] == "DualPipeV"


def test_too_few_micro_batches_is_one_problem_naming_the_flag():
    p = plan([*MODEL, "--global-batch-size", "3", *FLAG], with_removes=False)
    assert not p.ok and any("2 x --pipeline-model-parallel-size = 4" in x and "--global-batch-size" in x
                            for x in p.problems)
    assert _plan(*FLAG, gbs=5).ok  # the V takes any count from 2P on, not only multiples of P
    assert not plan([*MODEL, "--global-batch-size", "5"], with_removes=False).ok  # the interleaved does not


def test_with_moe_fb_overlap_the_pairs_are_the_vs_and_both_halves_are_held():
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
           "--disable-bias-linear", "--use-flash-attn", "--npuspeed-device", "cuda", "--nproc-per-node", "4"]
    both, alone = _plan(*moe, *FLAG, "--moe-fb-overlap", gbs=12), _plan(*moe, *FLAG, gbs=12)
    m = 6  # 12 / DP 2
    assert both.effects.fb_pairs == both.fb_overlap.pairs == 2 * (m - 4 + 1) + 1
    assert both.ranks[0].in_flight == schedule.max_in_flight(2, 0, 2, m, V, taking_turns=True)
    assert alone.ranks[0].in_flight == schedule.max_in_flight(2, 0, 2, m, V) < both.ranks[0].in_flight


@pytest.mark.parametrize("p", range(2, 9))
def test_every_rank_holds_deepseeks_pp_plus_1_chunks(p):
    """DeepSeek's README: DualPipeV holds PP + 1 stages' activations a device (PP = 2P stages);
    the walk along order.py gives 2P + 1 chunk-micro-batches on every rank when a pair's halves
    take turns, 2P when its backward frees before its forward, against the interleaved
    schedule's 3P - 1 on rank 0."""
    for m in (2 * p, 2 * p + 3):
        assert {schedule.max_in_flight(p, r, 2, m, V, taking_turns=True) for r in range(p)} == {2 * p + 1}
        assert {schedule.max_in_flight(p, r, 2, m, V) for r in range(p)} == {2 * p}
    assert schedule.max_in_flight(p, 0, 2, 4 * p) == 3 * p - 1


def test_the_v_sends_less_at_pp2_where_both_ends_hand_off_inside_a_rank():
    v, megatron = _plan(*FLAG), _plan()
    assert v.comm["pp"] == megatron.comm["pp"] / 2
    assert Placement(4, 2, V).sends_per_microbatch() == Placement(4, 2).sends_per_microbatch() == 4
