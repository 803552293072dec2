"""--recompute-norm inside Megatron-Core, on one gloo rank.

Same weights, inputs and seeds with and without the flag: fp32 losses and every gradient
bit-identical (LayerNorm GPT with dropout; RMSNorm torch and fused), the norm outputs' storages
really empty between forward and backward and full again when the linear's backward reads them
(counters and the storages themselves), and the live bytes between forward and backward lower
by the norms' outputs and statistics.
"""
from __future__ import annotations

import gc

import pytest
import torch

from npuspeed.features.base import FeatureError

FLAG, NUM = "--recompute-norm", "--recompute-norm-num-layers"
SEQ, BATCH, HIDDEN, LAYERS, VOCAB = 64, 2, 64, 4, 64


def _stats():
    from npuspeed import telemetry
    from npuspeed.features.recompute_norm.norms import PREFIX

    return {k: telemetry.get(PREFIX + k) for k in ("selected", "freed", "freed_bytes", "kept_shared", "recomputed")}


def _feature():
    from npuspeed.features.recompute_norm import RecomputeNormFeature

    return RecomputeNormFeature()


@pytest.mark.parametrize("argv, message", [
    ([NUM, "2"], f"{NUM} 2 is given without {FLAG}"),
    ([FLAG, NUM, "0"], f"{NUM} must be a positive number"),
])
def test_bad_flags_are_clear_errors(npuspeed_runtime, argv, message):
    from feature_ctx import ctx_for

    ctx = ctx_for(argv)
    assert _feature().enabled(ctx.args)
    with pytest.raises(FeatureError, match=message):
        _feature().validate(ctx)


def test_flags_off_and_on(npuspeed_runtime):
    from feature_ctx import ctx_for

    off = ctx_for([])
    assert not _feature().enabled(off.args) and _feature().path(off) == "off"
    on = ctx_for([FLAG, NUM, "3"])
    _feature().validate(on)
    assert "CheckpointWithoutOutput" in _feature().path(on) and "first 3 layers" in _feature().path(on)


def _gpt(normalization="LayerNorm", **kw):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=4 * HIDDEN,
                               use_cpu_initialization=True, hidden_dropout=0.1, attention_dropout=0.1,
                               bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                               normalization=normalization, **kw)
    return GPTModel(config, get_gpt_layer_local_spec(normalization=normalization), vocab_size=VOCAB,
                    max_sequence_length=SEQ)


def _step(model, acc, probe=None):
    """One fwd+bwd under fixed seeds (after a warm-up step): loss, grads, bytes held after forward."""
    from megatron.core import tensor_parallel

    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
    labels = torch.roll(tokens, -1, 1)
    model(tokens, position_ids, None, labels=labels).float().mean().backward()
    torch.manual_seed(11)
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    model.zero_grad(set_to_none=True)
    gc.collect()
    before = acc.memory_allocated()
    loss = model(tokens, position_ids, None, labels=labels).float().mean()
    held = acc.memory_allocated() - before
    if probe is not None:
        probe()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, held


def _pair(with_features, argv, normalization="LayerNorm", probe=None):
    from megatron.core import tensor_parallel

    from npuspeed import get_accelerator

    acc = get_accelerator()
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    baseline = _gpt(normalization)
    expected = _step(baseline, acc)
    with with_features(argv):
        before = _stats()
        model = _gpt(normalization)
        model.load_state_dict(baseline.state_dict())
        got = _step(model, acc, probe and (lambda: probe(model)))
        delta = {k: v - before[k] for k, v in _stats().items()}
    return expected, got, delta


def _assert_same(expected, got, exact=True):
    (base_loss, base_grads, _), (loss, grads, _) = expected, got
    assert torch.equal(loss, base_loss)
    assert grads.keys() == base_grads.keys()
    for name, g in base_grads.items():
        if exact:
            assert torch.equal(grads[name], g), name
        else:
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_layernorm_gpt_fp32_bitwise_and_the_outputs_freed(megatron_mp, with_features):
    seen = []

    def probe(model):  # between forward and backward: every selected norm's output is empty
        for layer in model.decoder.layers:
            for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
                checkpoint = norm._npuspeed_recompute_norm_last
                seen.append(norm._npuspeed_recompute_norm is None and checkpoint.freed
                            and checkpoint.outputs[0].untyped_storage().nbytes() == 0
                            and checkpoint.outputs[0].shape == (SEQ, BATCH, HIDDEN))

    expected, got, delta = _pair(with_features, [FLAG], probe=probe)
    _assert_same(expected, got)
    assert seen == [True] * 2 * LAYERS  # each pending checkpoint was handed to its linear's hook
    assert delta["selected"] == 2 * LAYERS
    # 2 steps (warm-up + measured) x 2 norms x layers, each freed and recomputed once
    assert delta["freed"] == delta["recomputed"] == 2 * 2 * LAYERS and delta["kept_shared"] == 0
    assert delta["freed_bytes"] == 2 * 2 * LAYERS * SEQ * BATCH * HIDDEN * 4


@pytest.mark.parametrize("fused", [False, True], ids=["torch-rmsnorm", "fused-rmsnorm"])
def test_rmsnorm_bitwise(megatron_mp, with_features, fused, monkeypatch):
    from npuspeed.ops._extension import has_op

    if fused and not has_op("rms_norm"):
        pytest.skip("npuspeed's fused RMSNorm op is not built here")
    # the fused kernel in both runs: under the recompute the norm's forward runs without grad, a
    # different key of the per-shape choice, which could pick another kernel (other rounding)
    monkeypatch.setenv("NPUSPEED_FUSED_OP_PATH", "cpp")
    argv = [FLAG] + (["--use-fused-rmsnorm"] if fused else [])
    if fused:  # the baseline is the fused norm without recompute
        from megatron.core import tensor_parallel

        from npuspeed import get_accelerator

        acc = get_accelerator()
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        with with_features(["--use-fused-rmsnorm"]):
            baseline = _gpt("RMSNorm")
            expected = _step(baseline, acc)
        with with_features(argv):
            before = _stats()
            model = _gpt("RMSNorm")
            assert type(model.decoder.layers[0].input_layernorm).__name__ == "FusedRMSNorm"
            model.load_state_dict(baseline.state_dict())
            got = _step(model, acc)
            freed = _stats()["freed"] - before["freed"]
    else:
        expected, got, delta = _pair(with_features, argv, "RMSNorm")
        freed = delta["freed"]
    # torch's RMSNorm is composite: x reaches its gradient through pow and mul, and with the
    # residual that is three terms summed into x's gradient, grouped differently once the norm
    # runs under a checkpoint (fp32 addition does not associate). The fused norm and
    # LayerNorm have one backward each: bit for bit.
    _assert_same(expected, got, exact=fused)
    assert freed == 2 * 2 * LAYERS


def test_first_n_layers_only(megatron_mp, with_features):
    expected, got, delta = _pair(with_features, [FLAG, NUM, "1"])
    _assert_same(expected, got)
    assert delta["selected"] == 2 and delta["freed"] == delta["recomputed"] == 2 * 2


def test_memory_held_drops_by_the_norm_outputs(megatron_mp, with_features):
    from npuspeed import get_accelerator

    acc = get_accelerator()
    if acc.name == "cpu" and not acc.enable_memory_tracking():
        pytest.skip("tracking allocator unavailable: " + acc.memory_tracking())
    (_, _, base_held), (_, _, held), _ = _pair(with_features, [FLAG])
    outputs = 2 * LAYERS * SEQ * BATCH * HIDDEN * 4
    stats = 2 * LAYERS * 2 * SEQ * BATCH * 4  # LayerNorm's mean and rstd, fp32
    # exactly: a norm checkpoint keeps no RNG states (random=False) and nothing else
    assert base_held - held == outputs + stats, (base_held, held, outputs, stats)


def test_full_recompute_wins_and_says_so(megatron_mp, with_features):
    notes = []
    from npuspeed.features.recompute_norm.norms import select

    with with_features([FLAG]):
        model = _gpt(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
        before = _stats()["selected"]
        select(model.decoder, None, notes.append)  # again, by hand, to see its notes
    assert any("full recompute wins" in n for n in notes)
    assert _stats()["selected"] - before == 2 * (LAYERS - 2)
