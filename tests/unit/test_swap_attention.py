"""--swap-attention inside Megatron-Core, on one gloo rank (the CPU backend: the host is the
device, so the mechanics are what is tested here; the memory gain needs an accelerator).

Same weights, inputs and seeds with and without the flag: fp32 loss and every gradient bit for
bit; each layer's attention storages copied out in forward and back in backward (byte counts
equal), the device tensors themselves gone between forward and backward (nothing else holds
them), and the backward order: layer i is fetched while layer i+1's backward runs, before its
own backward uses it. Bad flags are one-line errors.
"""
from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch

from npuspeed.features.base import FeatureError

FLAG, MODS = "--swap-attention", "--swap-modules"
#: every group's copies run on the CPU too (the default sizing swaps nothing where copies cannot
#: hide): the mechanics tests use it
WHOLE = [FLAG, "--swap-attention-mode", "whole"]
SEQ, BATCH, HIDDEN, LAYERS, VOCAB = 64, 2, 64, 3, 64


def _feature():
    from npuspeed.features.swap_attention import SwapAttentionFeature

    return SwapAttentionFeature()


@pytest.mark.parametrize("argv, message", [
    ([MODS, "mlp"], f"{MODS} mlp is given without {FLAG}"),
    ([FLAG, MODS, "attn"], f"{MODS} 'attn': unknown module attn"),
    ([FLAG, MODS, "mlp", "--recompute-activation-function"], "drop one of them"),
    (["--swap-attention-mode", "whole"], "--swap-attention-mode whole is given without --swap-attention"),
    ([FLAG, "--swap-attention-mode", "all"], "--swap-attention-mode 'all': give hidden .* or whole"),
])
def test_bad_flags_are_clear_errors(npuspeed_runtime, argv, message):
    from feature_ctx import ctx_for

    ctx = ctx_for(argv)
    assert _feature().enabled(ctx.args)
    with pytest.raises(FeatureError, match=message):
        _feature().validate(ctx)


def test_a_device_without_pinned_memory_is_refused_and_cpu_says_it_saves_nothing(npuspeed_runtime):
    from feature_ctx import ctx_for

    ctx = ctx_for([FLAG])
    device = types.SimpleNamespace(name="npu", host_is_device=lambda: False, has_pinned_memory=lambda: False)
    with pytest.raises(FeatureError, match="needs page-locked host memory"):
        _feature().validate(types.SimpleNamespace(args=ctx.args, accelerator=device, note=ctx.note))
    notes = []
    _feature().validate(types.SimpleNamespace(args=ctx.args, accelerator=ctx.accelerator, note=notes.append))
    assert any("the host is the device" in n and "nothing is saved" in n for n in notes)
    cpu = types.SimpleNamespace(device=ctx.accelerator.name)  # the planned device (RunSpec.device)
    assert "host is the device" in _feature().plan_effect(cpu, ctx).summary


def _stats():
    from npuspeed import telemetry
    from npuspeed.features.swap_attention.swap import PREFIX

    return {k: telemetry.get(PREFIX + k) for k in ("groups", "out_bytes", "in_bytes", "prefetched", "on_demand")}


def _gpt(**kw):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=4 * HIDDEN,
                               use_cpu_initialization=True, hidden_dropout=0.1, attention_dropout=0.1,
                               bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                               **kw)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)


def _step(model, probe=None):
    from megatron.core import tensor_parallel

    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
    torch.manual_seed(11)
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    model.zero_grad(set_to_none=True)
    loss = model(tokens, position_ids, None, labels=torch.roll(tokens, -1, 1)).float().mean()
    if probe is not None:
        probe()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gpt_bitwise_copied_out_freed_and_fetched_one_layer_ahead(megatron_mp, with_features, monkeypatch):
    from megatron.core import tensor_parallel

    from npuspeed.features.swap_attention import swap

    tensor_parallel.model_parallel_cuda_manual_seed(7)
    baseline = _gpt()
    base_loss, base_grads = _step(baseline)

    sources = []
    copy_out = swap.SwapGroup._copy_out

    def recording(self, t, nbytes):  # what was copied out: the device tensors, weakly
        sources.append(weakref.ref(t))
        return copy_out(self, t, nbytes)

    monkeypatch.setattr(swap.SwapGroup, "_copy_out", recording)
    alive = []

    def probe():  # between forward and backward
        gc.collect()
        alive.append(sum(r() is not None for r in sources))

    with with_features(WHOLE):
        model = _gpt()
        model.load_state_dict(baseline.state_dict())
        manager = swap.current()
        manager.order = []
        before = _stats()
        loss, grads = _step(model, probe)
        delta = {k: v - before[k] for k, v in _stats().items()}
    assert torch.equal(loss, base_loss)
    assert grads.keys() == base_grads.keys()
    for name, g in base_grads.items():
        assert torch.equal(grads[name], g), name
    assert delta["groups"] == LAYERS and delta["out_bytes"] == delta["in_bytes"] > 0
    # the top layer is fetched on demand, every other one while the layer above ran backward
    assert delta["on_demand"] == 1 and delta["prefetched"] == LAYERS - 1
    assert sources and alive == [0], (len(sources), alive)  # every copied-out device tensor was freed
    names = [f"layer{i}.self_attention" for i in range(1, LAYERS + 1)]
    order = manager.order
    outs = [n for what, n in order if what == "out"]
    assert sorted(set(outs), key=names.index) == names and outs == sorted(outs, key=names.index)
    backward = [(what, n) for what, n in order if what != "out"]
    expected = [("fetch", names[-1]), ("use", names[-1])]
    for i in range(LAYERS - 2, -1, -1):
        expected += [("fetch", names[i]), ("use", names[i])]
    assert backward == expected, backward
    # each fetch of layer i comes right after layer i+1 began its backward: one layer ahead
    for i in range(LAYERS - 1):
        assert backward.index(("fetch", names[i])) == backward.index(("use", names[i + 1])) + 1


@pytest.mark.parametrize("modules, kw", [
    ("core_attention", {}),
    ("self_attention", {"recompute_granularity": "selective"}),
], ids=["core-attention", "attention-block-under-selective-recompute"])
def test_other_modules_and_selective_recompute(megatron_mp, with_features, modules, kw):
    """Core attention alone; and the attention block under Megatron's selective recompute,
    whose checkpoint's saved q, k, v are swapped while its rerun inside backward is not (it is
    consumed at once)."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(7)
    baseline = _gpt(**kw)
    base_loss, base_grads = _step(baseline)
    with with_features(WHOLE + [MODS, modules]):
        model = _gpt(**kw)
        model.load_state_dict(baseline.state_dict())
        before = _stats()
        loss, grads = _step(model)
        delta = {k: v - before[k] for k, v in _stats().items()}
    assert torch.equal(loss, base_loss)
    assert all(torch.equal(grads[n], g) for n, g in base_grads.items())
    assert delta["groups"] == LAYERS and delta["out_bytes"] == delta["in_bytes"] > 0


def test_with_recompute_norm_the_norm_output_is_left_to_the_recompute(megatron_mp, with_features):
    """--recompute-norm frees each input norm's output after linear_qkv saved it and recomputes it
    in backward: the swap of the attention block must not also copy it out (paid twice, and
    backward would hold both the fetched copy and the recomputed tensor). Same loss and grads."""
    from megatron.core import tensor_parallel

    from npuspeed import telemetry
    from npuspeed.features.recompute_norm.norms import PREFIX as NORM

    tensor_parallel.model_parallel_cuda_manual_seed(7)
    baseline = _gpt()
    base_loss, base_grads = _step(baseline)
    out_bytes, skipped = {}, {}
    for argv in (WHOLE, WHOLE + ["--recompute-norm"]):
        with with_features(argv):
            model = _gpt()
            model.load_state_dict(baseline.state_dict())
            before, skip0, freed0 = _stats(), telemetry.get("swap.skipped_recomputed"), telemetry.get(NORM + "freed")
            loss, grads = _step(model)
            out_bytes[len(argv) - 2] = _stats()["out_bytes"] - before["out_bytes"]
            skipped[len(argv) - 2] = telemetry.get("swap.skipped_recomputed") - skip0
            freed = telemetry.get(NORM + "freed") - freed0
        assert torch.equal(loss, base_loss)
        assert all(torch.equal(grads[n], g) for n, g in base_grads.items())
    assert skipped == {1: 0, 2: LAYERS} and freed == 2 * LAYERS
    norm_output = SEQ * BATCH * HIDDEN * 4  # fp32 [s, b, h] per layer
    assert out_bytes[1] - out_bytes[2] == LAYERS * norm_output, out_bytes


def _sized_run(with_features, argv, baseline, steps):
    """`steps` forward-backward passes with `argv`; (per pass: loss, grads, counter deltas), the manager."""
    from npuspeed.features.swap_attention import swap

    out = []
    with with_features(argv):
        model = _gpt()
        model.load_state_dict(baseline.state_dict())
        manager = swap.current()
        for _ in range(steps):
            before = _stats() | {"groups_kept": _kept()}
            loss, grads = _step(model)
            out.append((loss, grads, {k: v - before[k] for k, v in (_stats() | {"groups_kept": _kept()}).items()}))
    return out, manager


def _kept():
    from npuspeed import telemetry

    return telemetry.get("swap.groups_kept")


@pytest.mark.parametrize("mode", ["hidden", "whole"])
def test_sizing_partial_swap_is_bitwise_and_whole_moves_all(megatron_mp, with_features, mode):
    """A fast fake link (10 GB/s) that overlaps compute: after the measured passes the hidden sizing swaps
    layers 1-2 and keeps the top one (nothing above it starts its fetch), and every pass's loss
    and gradients are bit for bit those of the run without the flag; whole swaps every layer and
    states its cost. The decision's measured wait is filled in after the next pass."""
    from megatron.core import tensor_parallel

    from npuspeed.accelerator import host_link
    from npuspeed.features.swap_attention import sizer
    from npuspeed.offload import decisions

    decisions.reset()
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    baseline = _gpt()
    base_loss, base_grads = _step(baseline)
    steps = sizer.SKIP + sizer.MEASURE + 2
    with host_link.fake(1e10):  # a layer's ~0.2 MB: ~20 us each way, far under its compute here
        runs, manager = _sized_run(with_features, [FLAG, "--swap-attention-mode", mode], baseline, steps)
    for loss, grads, _ in runs:
        assert torch.equal(loss, base_loss)
        assert all(torch.equal(grads[n], g) for n, g in base_grads.items())
    names = [f"layer{i}.self_attention" for i in range(1, LAYERS + 1)]
    assert all(delta["groups"] == LAYERS for _, _, delta in runs[:sizer.SKIP + sizer.MEASURE])  # measuring: all
    after = runs[-1][2]
    if mode == "hidden":
        assert manager.sizer.moved == set(names[:-1])
        assert after["groups"] == LAYERS - 1 and after["groups_kept"] == 1
        assert after["out_bytes"] == after["in_bytes"] > 0 and after["prefetched"] == LAYERS - 1
    else:
        assert manager.sizer.moved == set(names) and after["groups"] == LAYERS and after["groups_kept"] == 0
    (made,) = decisions.all_dicts()
    assert made["mode"] == mode and made["bytes_moved"] == after["out_bytes"]
    assert made["exposed_ms_measured"] is not None and made["measured_samples"] == 1
    assert ("cost: about" in made["line"]) == (mode == "whole")


def test_on_the_cpu_the_hidden_sizing_moves_nothing_and_says_why(megatron_mp, with_features):
    """The real CPU link: copies run in order with compute, none can hide, so no layer swaps from
    the first pass on and none is timed (the run is the plain one: no copy held beside its tensor,
    the planner's "nothing changes on the host"), and the decision, recorded once the first pass
    named the layers, says why for each."""
    from megatron.core import tensor_parallel

    from npuspeed.features.swap_attention import sizer
    from npuspeed.offload import decisions

    decisions.reset()
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    baseline = _gpt()
    base_loss, _ = _step(baseline)
    runs, manager = _sized_run(with_features, [FLAG], baseline, sizer.SKIP + sizer.MEASURE + 1)
    assert all(torch.equal(loss, base_loss) for loss, _, _ in runs)
    assert manager.sizer.moved == set() and not manager.sizer.marks.read()
    assert all(d["groups"] == 0 and d["out_bytes"] == 0 and d["groups_kept"] == LAYERS for _, _, d in runs)
    (made,) = decisions.all_dicts()
    assert made["moved"] == [] and len(made["kept"]) == LAYERS
    assert all("in order" in why for why in made["kept"].values())
    assert made["link"]["overlaps"] is False and made["link"]["source"].startswith("not measured")
