"""--moe-fb-overlap at PP > 1 without processes: the refusals (a release without the
interleaved schedule's extra warm-up micro-batch, no VPP, too few micro-batches), and the paired
step's order: Megatron's pre-processing and receive hooks forward's first, then the pair, then
post-processing and send hooks forward's first, as Megatron's combined step issues them (every
rank must issue its pipeline sends and receives in the same order)."""
from __future__ import annotations

import argparse

import pytest

from npuspeed.features.base import FeatureError
from npuspeed.features.moe_fb_overlap import interleaved, moe_fb_overlap_feature as feature


@pytest.fixture(autouse=True)
def _release_with_the_schedule(monkeypatch):
    """The checks after the release's: as on 0.14+ whatever is installed."""
    monkeypatch.setattr(feature, "in_range", lambda spec: True)


def _m(**given):
    base = dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1,
                virtual_pipeline_model_parallel_size=None, global_batch_size=8, micro_batch_size=1,
                tensor_model_parallel_size=None, context_parallel_size=None)
    base.update(given)
    return argparse.Namespace(**base)


def test_old_release_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(feature, "in_range", lambda spec: False)
    with pytest.raises(FeatureError, match=r"upgrade megatron-core to 0\.14\+ or use --pipeline-model-parallel-size 1"):
        feature._pipeline("--moe-fb-overlap", 2, _m())


def test_pp_without_vpp_refused():
    with pytest.raises(FeatureError, match="add --num-layers-per-virtual-pipeline-stage"):
        feature._pipeline("--moe-fb-overlap", 2, _m(num_layers_per_virtual_pipeline_stage=None))


@pytest.mark.parametrize("gbs, refused", [(4, True), (6, False), (8, False)])
def test_micro_batches_must_outnumber_stages(monkeypatch, gbs, refused):
    monkeypatch.setenv("WORLD_SIZE", "4")  # DP 2 at PP 2: 4 / (1 x 2) = 2 micro-batches
    if refused:
        with pytest.raises(FeatureError, match=r"\(2 <= 2\): raise --global-batch-size"):
            feature._pipeline("--moe-fb-overlap", 2, _m(global_batch_size=gbs))
    else:
        feature._pipeline("--moe-fb-overlap", 2, _m(global_batch_size=gbs))


def _step(monkeypatch, f_id, b_id, hooks=True):
    calls = []
    monkeypatch.setattr(interleaved, "forward_chunk", lambda *a: calls.append("forward") or ("out", 3))
    monkeypatch.setattr(interleaved, "backward_chunk", lambda *a: calls.append("backward") or "grad")
    rec = lambda name, ret=None: (lambda *a: calls.append(name) or ret)  # noqa: E731
    out = interleaved.paired_step(
        None, None, [None, None], [None, None], 4, [],
        rec("f_pre", "input"), rec("f_post"), rec("b_pre", ("i", "o", "g")), rec("b_post"),
        lambda vid, forward: 0, lambda vid, forward: 1, lambda cond: cond, lambda vid: False, False,
        f_virtual_microbatch_id=f_id, b_virtual_microbatch_id=b_id,
        pre_forward=rec("pre_forward") if hooks else None, pre_backward=rec("pre_backward") if hooks else None,
        post_forward=(lambda t, chunk: calls.append("post_forward") or t) if hooks else None,
        post_backward=(lambda t, chunk: calls.append("post_backward") or t) if hooks else None)
    return out, calls


def test_paired_step_keeps_megatrons_hook_order(monkeypatch):
    from npuspeed import telemetry

    before = telemetry.snapshot().get("moe.fb_overlap.pairs", 0)
    out, calls = _step(monkeypatch, 5, 0)
    assert out == ("out", "grad")
    assert calls[:4] == ["f_pre", "b_pre", "pre_forward", "pre_backward"]
    assert sorted(calls[4:6]) == ["backward", "forward"]  # the pair (the backward takes the first turn)
    assert calls[6:] == ["f_post", "post_forward", "b_post", "post_backward"]
    assert telemetry.snapshot().get("moe.fb_overlap.pairs", 0) == before + 1


def test_warm_up_and_cool_down_steps_run_alone(monkeypatch):
    out, calls = _step(monkeypatch, 2, None, hooks=False)
    assert out == ("out", None) and calls == ["f_pre", "forward", "f_post"]
    out, calls = _step(monkeypatch, None, 7, hooks=False)
    assert out == (None, "grad") and calls == ["b_pre", "backward", "b_post"]
