"""The speed model on a synthetic profile (tests never time anything): the pipeline schedule's
bubble, layers and micro-batches, DP and optimizer terms, kernel and recompute differences."""
from __future__ import annotations

import pytest

from npuspeed.plan import schedule
from npuspeed.plan.calibrate import groups
from npuspeed.plan.speed import group_key
from npuspeed.plan.planner import plan

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--bf16"]
MS = 1e-3


def _group(layer=(2 * MS, 4 * MS), emb=(0.5 * MS, 0.5 * MS), head=(1 * MS, 2 * MS)):
    """Measured at (1, 256) and (1, 128): a fixed half and a per-token half."""
    def at(f, b, frac):
        return [f * (0.5 + 0.5 * frac), b * (0.5 + 0.5 * frac)]

    pre = (layer[0] + emb[0], layer[1] + emb[1])
    full = (pre[0] + head[0], pre[1] + head[1])
    return {"tokens": [[1, 256], [1, 128]], "layer": [at(*layer, 1), at(*layer, .5)],
            "pre": [at(*pre, 1), at(*pre, .5)], "full": [at(*full, 1), at(*full, .5)], "schedule": 0.0}


def profile(**over):
    p = {"version": 2, "world": 2, "variants": {}, "recompute_granularity": None,
         "groups": {group_key(1, False): _group(), group_key(2, False): _group(layer=(1.5 * MS, 3 * MS)),
                    group_key(2, True): _group(layer=(1.6 * MS, 3.2 * MS))},
         "optimizer": {"plain": {"points": [[1e6, 4e6, 1 * MS, 2 * MS], [2e6, 8e6, 2 * MS, 4 * MS]]},
                       "distributed": {"points": [[1e6, 4e6, 1 * MS, 1 * MS], [2e6, 8e6, 2 * MS, 2 * MS]]}},
         "collective": {"all_reduce": [[4096, 1e-4], [1 << 22, 4e-3]], "p2p": [[4096, 1e-5], [1 << 22, 1e-3]]},
         "attention": {"bf16": {"unfused": 1e-10, "flash": 5e-11, "sdpa_math": 2e-10}},
         "elementwise_s_per_byte": {"bf16": 1e-10}}
    p.update(over)
    return p


def _speed(*flags, prof=None):
    p = plan([*MODEL, *flags, "--nproc-per-node", "2"], profile=prof or profile(), with_removes=False)
    assert p.ok, p.problems
    return p.speed


def test_1f1b_bubble_is_stages_minus_one_micro_batches():
    f, b, m = [[1.0], [1.0]], [[2.0], [2.0]], 4
    assert schedule.simulate(2, 1, m, f, b) == pytest.approx((m + 1) * 3)
    assert schedule.simulate(2, 2, m, [[.5, .5]] * 2, [[1, 1]] * 2) == pytest.approx(m * 3 + 1.5)  # interleaved
    assert schedule.simulate(2, 1, m, f, b, hop=0.1) > (m + 1) * 3


def test_step_is_micro_batches_of_layers_plus_ends_dp_and_optimizer():
    s = _speed()  # DP 2: 2 micro-batches of 4 layers, embedding and head
    per_mb = 4 * 6 + 1 + 3
    assert s.compute_ms == pytest.approx(2 * per_mb)
    assert s.bubble_ms == pytest.approx(0)
    assert s.comm_ms["dp"] > 0 and s.optimizer_ms > 0
    assert s.step_ms == pytest.approx(s.compute_ms + s.comm_ms["dp"] + s.optimizer_ms)


def test_tensor_parallel_prices_its_own_calibrated_group_and_has_no_dp_reduction():
    tp = _speed("--tensor-model-parallel-size", "2")
    assert tp.group == group_key(2, False) and tp.comm_ms["dp"] == 0
    assert tp.layer_ms == pytest.approx((1.5, 3.0))
    assert _speed("--tensor-model-parallel-size", "2", "--sequence-parallel").group == group_key(2, True)


def test_pipeline_adds_the_bubble_and_the_hop():
    pp = _speed("--pipeline-model-parallel-size", "2")
    assert pp.bubble_ms > 0 and pp.comm_ms["pp"] > 0
    assert pp.step_ms > pp.compute_ms


def test_a_smaller_micro_batch_keeps_the_fixed_part():
    one = _speed("--global-batch-size", "4")
    prof = profile()
    half = plan([*MODEL, "--seq-length", "128", "--nproc-per-node", "2"], profile=prof, with_removes=False).speed
    assert half.layer_ms[0] == pytest.approx(one.layer_ms[0] * 0.75)  # fixed half + half the per-token half


def test_attention_kernel_and_recompute_are_priced_by_their_difference():
    base = _speed("--attention-dropout", "0")
    flash = _speed("--attention-dropout", "0", "--use-flash-attn")
    assert flash.layer_ms[0] < base.layer_ms[0] and flash.layer_ms[1] < base.layer_ms[1]
    full = _speed("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
    assert full.layer_ms[1] == pytest.approx(base.layer_ms[1] + base.layer_ms[0])


def test_calibration_groups_cover_the_search():
    p = plan([*MODEL, "--nproc-per-node", "2"], with_removes=False)
    keys = set(groups(p.spec, 2))
    assert keys == {group_key(1, False), group_key(2, False), group_key(2, True)}
    cp = plan([*MODEL, "--use-flash-attn", "--context-parallel-size", "2", "--nproc-per-node", "2"], with_removes=False)
    assert group_key(1, False, 2) in groups(cp.spec, 2)


def test_a_cp_group_is_read_at_the_sequence_it_was_calibrated_with():
    """The profile's points are (micro-batch, whole sequence); a CP rank holds S/CP of it. A CP
    plan at the calibrated point gets the calibrated time back, not that of S/CP tokens."""
    prof = profile()
    prof["groups"][group_key(1, False, 2)] = _group(layer=(3 * MS, 6 * MS))
    cp = _speed("--use-flash-attn", "--attention-dropout", "0", "--context-parallel-size", "2", prof=prof)
    assert cp.group == group_key(1, False, 2)
    assert cp.layer_ms == pytest.approx((3.0, 6.0))


def test_the_profile_estimate_picks_the_fastest_or_the_median_repeats():
    """The calibration keeps each call's fastest and median repeats; the plan reads the fastest
    unless the profile's estimate says median (older profiles have the fastest alone)."""
    prof = profile()
    for g in prof["groups"].values():
        for part in ("layer", "pre", "full"):
            g[part + "_median"] = [[2 * t for t in row] for row in g[part]]
        g["schedule_median"] = 0.0
    for opt in prof["optimizer"].values():
        opt["points_median"] = [[p, n, 2 * f, 2 * s] for p, n, f, s in opt["points"]]
    fastest = _speed(prof=prof)
    assert fastest.step_ms == pytest.approx(_speed().step_ms)  # as a profile without medians
    typical = _speed(prof={**prof, "estimate": "median"})
    assert typical.layer_ms == pytest.approx(tuple(2 * t for t in fastest.layer_ms))
    assert typical.optimizer_ms == pytest.approx(2 * fastest.optimizer_ms)
    assert typical.step_ms == pytest.approx(2 * fastest.step_ms)
    with pytest.raises(ValueError, match="estimate"):
        _speed(prof={**prof, "estimate": "mean"})


def test_the_calibration_median_of_repeats():
    from npuspeed.plan.calib_worker import _median

    assert _median([3.0, 1.0, 2.0]) == 2.0 and _median([4.0, 1.0, 2.0, 3.0]) == 2.5


def test_activation_recompute_of_the_first_n_layers_is_priced_by_their_share():
    """The calibration times the activation recompute on every layer it builds (its chunks hold
    one or two layers, so `--recompute-activation-function-num-layers` is left out there); a
    plan recomputing the first N of a chunk's layers pays N / layers of that."""
    from npuspeed.plan.calibrate import LAYER_COUNT_FLAGS, without

    base = _speed()
    every = _speed("--recompute-activation-function")
    half = _speed("--recompute-activation-function", "--recompute-activation-function-num-layers", "2")
    extra = every.layer_ms[1] - base.layer_ms[1]
    assert extra > 0 and half.layer_ms[1] - base.layer_ms[1] == pytest.approx(extra / 2)
    calibrated = profile(variants={"mlp_activation": "recompute"})  # a profile timed with it on
    assert _speed("--recompute-activation-function", prof=calibrated).layer_ms[1] == pytest.approx(base.layer_ms[1])
    argv = ["--bf16", "--recompute-activation-function-num-layers", "2", "--recompute-activation-function-num-layers=3"]
    assert without(argv, LAYER_COUNT_FLAGS) == ["--bf16"]


def test_the_optimizer_is_timed_across_the_depth_a_rank_holds():
    """Interpolated between one layer and the run's depth (up to 4 layers), not extrapolated
    from a 1-vs-2-layer difference; the NaN check Megatron-LM runs on each bucket is timed
    with it unless the run turns it off."""
    from npuspeed.plan.calib_worker import optimizer_layers

    def spec(*flags):
        return plan([*MODEL, *flags, "--nproc-per-node", "2"], with_removes=False).spec

    assert optimizer_layers(spec()) == (1, 4)
    assert optimizer_layers(spec("--num-layers", "12")) == (1, 4)
    assert optimizer_layers(spec("--num-layers", "1")) == (1, 2)
    assert spec().extra["check_for_nan_in_grad"] is True
    assert spec("--no-check-for-nan-in-loss-and-grad").extra["check_for_nan_in_grad"] is False
