"""--recompute-activation-function inside Megatron-Core, on one gloo rank.

Same weights, inputs and seeds with and without the flag: fp32 outputs, losses and every
gradient are bit-identical (an MLP for each activation path, a GPT with dropout), bf16 losses
too. The activation's storage is really empty between forward and backward and is full again
when fc2's backward reads it; the accelerator's live-byte counts show the memory it saves.
"""
from __future__ import annotations

import gc
import inspect
import types

import pytest
import torch
import torch.nn.functional as F

from npuspeed.features.base import FeatureError

FLAG = "--recompute-activation-function"
NUM = "--recompute-activation-function-num-layers"


def _stats():
    from npuspeed import telemetry
    from npuspeed.features.activation_checkpoint import PREFIX

    names = ("freed", "freed_bytes", "kept_shared", "recomputed", "inputs_released")
    return {name: telemetry.get(PREFIX + name) for name in names}


def _delta(before: dict) -> dict:
    return {k: v - before[k] for k, v in _stats().items()}


def _config(**kw):
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False)
    base.update(kw)
    return TransformerConfig(**base)


# -- flags -------------------------------------------------------------------------------------
def _feature():
    from npuspeed.features.recompute_activation import RecomputeActivationFeature

    return RecomputeActivationFeature()


@pytest.mark.parametrize("argv, message", [
    ([NUM, "2"], f"{NUM} 2 is given without {FLAG}"),
    ([FLAG, NUM, "-1"], f"{NUM} must be a positive number"),
    ([FLAG, NUM, "0"], f"{NUM} must be a positive number"),
])
def test_bad_flags_are_clear_errors(npuspeed_runtime, argv, message):
    from feature_ctx import ctx_for

    ctx = ctx_for(argv)
    feature = _feature()
    assert feature.enabled(ctx.args)  # so that the runtime validates it
    with pytest.raises(FeatureError, match=message):
        feature.validate(ctx)


def test_flags_off_and_on(npuspeed_runtime):
    from feature_ctx import ctx_for

    off = ctx_for([])
    assert not _feature().enabled(off.args) and _feature().path(off) == "off"
    on = ctx_for([FLAG, NUM, "3"])
    _feature().validate(on)
    assert "CheckpointWithoutOutput" in _feature().path(on)
    assert "first 3 layers of each pipeline stage" in _feature().path(on)


def test_num_layers_beyond_the_stage_is_refused_at_build(megatron_mp, with_features):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    with with_features([FLAG, NUM, "3"]):
        with pytest.raises(FeatureError, match=f"{NUM} 3 is larger than the 2 transformer layers"):
            TransformerBlock(_config(), get_gpt_layer_local_spec())


# -- one MLP -----------------------------------------------------------------------------------
def _mlp(config):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    kw = {"ffn_hidden_size": config.ffn_hidden_size} if "ffn_hidden_size" in inspect.signature(MLP).parameters else {}
    return MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear), **kw)


def _run_mlp(mlp, x):
    leaf = x.clone().requires_grad_()
    out, bias = mlp(leaf)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype))
    grads = {n: p.grad.clone() for n, p in mlp.named_parameters() if p.grad is not None}
    mlp.zero_grad(set_to_none=True)
    return out.detach(), None if bias is None else bias.detach(), leaf.grad, grads


def _assert_bitwise(a, b):
    out_a, bias_a, in_a, par_a = a
    out_b, bias_b, in_b, par_b = b
    assert torch.equal(out_a, out_b) and torch.equal(in_a, in_b)
    assert (bias_a is None) == (bias_b is None) and (bias_a is None or torch.equal(bias_a, bias_b))
    assert par_a.keys() == par_b.keys() and par_a
    for name in par_a:
        assert torch.equal(par_a[name], par_b[name]), name


MLP_CASES = {
    "gelu": dict(gated_linear_unit=False, activation_func=F.gelu, add_bias_linear=False),
    "gelu+bias": dict(gated_linear_unit=False, activation_func=F.gelu, add_bias_linear=True),
    "swiglu": dict(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False),
    "swiglu+bias": dict(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(MLP_CASES))
def test_mlp_bitwise_parity(megatron_mp, with_features, case, dtype):
    from npuspeed.features.recompute_activation.mlp import ATTR

    mlp = _mlp(_config(params_dtype=dtype, **MLP_CASES[case]))
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(6, 3, 32).to(dtype)
    expected = _run_mlp(mlp, x)
    before = _stats()
    with with_features([FLAG]):
        setattr(mlp, ATTR, True)  # as the block selection does (tested below)
        got = _run_mlp(mlp, x)
    _assert_bitwise(got, expected)
    act_bytes = 6 * 3 * 64 * x.element_size()
    # With a bias the recompute's graph saves x + bias, so fc1's output itself goes early.
    released = int(MLP_CASES[case]["add_bias_linear"])
    assert _delta(before) == {"freed": 1, "freed_bytes": act_bytes, "kept_shared": 0, "recomputed": 1,
                              "inputs_released": released}


@pytest.mark.parametrize("fusion", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_mlp_with_fused_swiglu(megatron_mp, with_features, bias, fusion, monkeypatch):
    """Both features on: the fused op computes the activation in forward and in the recompute."""
    monkeypatch.setenv("NPUSPEED_FUSED_OP_PATH", "cpp")  # the C++ kernel, recomputed (counted below)
    from npuspeed.ops._extension import has_op

    if not has_op("swiglu"):
        pytest.skip("C++ op library not built")
    from npuspeed.features.recompute_activation.mlp import ATTR
    from npuspeed.ops import _dispatch

    kw = dict(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=bias, bias_activation_fusion=fusion)
    x = torch.randn(6, 3, 32)
    with with_features(["--use-fused-swiglu"]):
        mlp = _mlp(_config(**kw))
        with torch.no_grad():
            for p in mlp.parameters():
                p.normal_(0, 0.2)
        expected = _run_mlp(mlp, x)
    _dispatch.reset_calls()
    before = _stats()
    with with_features(["--use-fused-swiglu", FLAG]):
        setattr(mlp, ATTR, True)
        got = _run_mlp(mlp, x)
    _assert_bitwise(got, expected)
    assert _dispatch.calls().get(("swiglu", "cpp"), 0) == 2  # forward + recompute
    assert _delta(before)["recomputed"] == 1


def test_storage_freed_between_forward_and_backward_and_back_for_fc2(megatron_mp, with_features):
    """fc2 saved the activation; it is empty after forward, full (and right) when fc2 reads it."""
    from npuspeed.features.recompute_activation.mlp import ATTR

    mlp = _mlp(_config(**MLP_CASES["gelu+bias"]))
    x = torch.randn(5, 2, 32)
    seen = {}
    with torch.no_grad():
        fc1_out, fc1_bias = mlp.linear_fc1(x)
        reference = F.gelu(fc1_out + fc1_bias)
    mlp.linear_fc2.register_forward_pre_hook(lambda _m, inputs: seen.update(act=inputs[0]))

    def pack(t):
        return t

    def unpack(t):
        if t is seen["act"]:  # fc2's backward reading its saved input
            seen["nbytes_at_fc2_backward"] = t.untyped_storage().nbytes()
            seen["equal_at_fc2_backward"] = torch.equal(t, reference)
        return t

    with with_features([FLAG]):
        setattr(mlp, ATTR, True)
        leaf = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out, _ = mlp(leaf)
        act = seen["act"]
        assert act.shape == (5, 2, 64)
        assert act.untyped_storage().nbytes() == 0  # freed between forward and backward
        out.sum().backward()
    assert seen["nbytes_at_fc2_backward"] == 5 * 2 * 64 * 4
    assert seen["equal_at_fc2_backward"]


def test_recomputed_activation_is_one_live_copy_when_fc2_reads_it(megatron_mp, with_features):
    """0.12-0.16 copy the recomputed activation into the released storage (the recomputed copy
    is then released); 0.17+ re-point that storage at the recomputed data, so there is no
    second copy to release: releasing it there would free what fc2's backward reads (memory
    that the next allocations reuse, filled with NaN here)."""
    from npuspeed import telemetry
    from npuspeed.features.activation_checkpoint import PREFIX
    from npuspeed.features.recompute_activation.mlp import ATTR
    from npuspeed.patching.versions import in_range

    mlp = _mlp(_config(**MLP_CASES["gelu+bias"]))
    x = torch.randn(5, 2, 32)
    with torch.no_grad():
        fc1_out, fc1_bias = mlp.linear_fc1(x)
        reference = F.gelu(fc1_out + fc1_bias)
    seen = {}
    mlp.linear_fc2.register_forward_pre_hook(lambda _m, inputs: seen.update(act=inputs[0]))

    def unpack(t):
        if t is seen.get("act"):
            seen["fillers"] = [torch.full_like(t, float("nan")) for _ in range(8)]
            seen["equal"] = torch.equal(t, reference)
        return t

    with with_features([FLAG]):
        setattr(mlp, ATTR, True)
        before = telemetry.get(PREFIX + "shared")
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            out, _ = mlp(x.clone().requires_grad_())
        out.sum().backward()
    assert seen["equal"]
    assert telemetry.get(PREFIX + "shared") - before == (1 if in_range(">=0.17") else 0)


# -- which layers ------------------------------------------------------------------------------
def _fake_block(num_layers, per_block, pp=1, vpp=None, vp_stage=None, **config):
    from megatron.core.transformer.mlp import MLP

    mlp_config = _config()
    cfg = types.SimpleNamespace(num_layers=num_layers, pipeline_model_parallel_size=pp,
                                virtual_pipeline_model_parallel_size=vpp, recompute_granularity=None,
                                recompute_method=None, recompute_num_layers=None)
    vars(cfg).update(config)
    layers = [types.SimpleNamespace(mlp=_mlp(mlp_config)) for _ in range(per_block)]
    assert all(isinstance(layer.mlp, MLP) for layer in layers)
    return types.SimpleNamespace(config=cfg, vp_stage=vp_stage, layers=layers)


def _selected(block):
    from npuspeed.features.recompute_activation.mlp import ATTR

    return [getattr(layer.mlp, ATTR, False) for layer in block.layers]


def test_first_n_layers_of_each_stage_interleaved_across_virtual_chunks(megatron_mp, with_features):
    from npuspeed.features.recompute_activation.layers import select

    with with_features([FLAG]):
        block = _fake_block(8, 4, pp=2)
        select(block, 3, [].append)
        assert _selected(block) == [True, True, True, False]
        block = _fake_block(8, 4, pp=2)
        select(block, None, [].append)
        assert _selected(block) == [True] * 4
        # PP2 x VPP2, 8 layers: a stage holds two chunks of 2; N=3 takes positions 0 of both
        # chunks, then position 1 of chunk 0.
        chunks = [_fake_block(8, 2, pp=2, vpp=2, vp_stage=v) for v in (0, 1)]
        for chunk in chunks:
            select(chunk, 3, [].append)
        assert [_selected(c) for c in chunks] == [[True, True], [True, False]]
        with pytest.raises(FeatureError, match=f"{NUM} 5 is larger than the 4"):
            select(_fake_block(8, 2, pp=2, vpp=2, vp_stage=0), 5, [].append)


def test_full_recompute_wins_offloading_excludes_and_both_say_so(megatron_mp, with_features):
    from npuspeed.features.recompute_activation.layers import select

    notes = []

    with with_features([FLAG]):
        block = _fake_block(4, 4, recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
        select(block, None, notes.append)
        assert _selected(block) == [False, False, True, True]
        block = _fake_block(4, 4, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        select(block, None, notes.append)
        assert _selected(block) == [False] * 4
        block = _fake_block(4, 4, recompute_granularity="selective")
        select(block, None, notes.append)
        assert _selected(block) == [True] * 4
        block = _fake_block(4, 4, cpu_offloading=True)
        select(block, None, notes.append)
        assert _selected(block) == [False] * 4
    assert any("full recompute wins" in n for n in notes)
    assert any("offloaded to the host" in n for n in notes)


# -- a whole GPT -------------------------------------------------------------------------------
SEQ, BATCH, HIDDEN, LAYERS, VOCAB = 256, 4, 64, 4, 64


def _gpt(dtype=torch.float32, **kw):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = _config(num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=4 * HIDDEN,
                     hidden_dropout=0.1, attention_dropout=0.1, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                     **kw)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    if dtype == torch.bfloat16:  # as Megatron-LM: bf16 inside, fp32 losses out
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def _gpt_step(model, acc):
    """One fwd+bwd under fixed seeds: loss, grads, bytes held after forward, step peak."""
    from megatron.core import tensor_parallel

    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
    labels = torch.roll(tokens, -1, 1)
    # A first step creates what Megatron keeps across steps (caches, buffers); measure the second.
    model(tokens, position_ids, None, labels=labels).float().mean().backward()
    torch.manual_seed(11)
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    model.zero_grad(set_to_none=True)
    gc.collect()
    before = acc.memory_allocated()
    acc.reset_peak_memory_stats()
    loss = model(tokens, position_ids, None, labels=labels).float().mean()
    held = acc.memory_allocated() - before
    loss.backward()
    peak = acc.max_memory_allocated() - before
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, held, peak


def _gpt_pair(with_features, argv, dtype=torch.float32, **kw):
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(7)
    baseline = _gpt(dtype, **kw)
    acc = megatron_acc()
    expected = _gpt_step(baseline, acc)
    with with_features(argv):
        model = _gpt(dtype, **kw)
        model.load_state_dict(baseline.state_dict())
        before = _stats()
        got = _gpt_step(model, acc)
        delta = _delta(before)
    return expected, got, delta


def megatron_acc():
    from npuspeed import get_accelerator

    return get_accelerator()


def test_gpt_fp32_bitwise_with_dropout(megatron_mp, with_features):
    (base_loss, base_grads, _, _), (loss, grads, _, _), delta = _gpt_pair(with_features, [FLAG])
    assert torch.equal(loss, base_loss)
    assert grads.keys() == base_grads.keys()
    for name, g in base_grads.items():
        assert torch.equal(grads[name], g), name
    assert delta["freed"] == delta["recomputed"] == 2 * LAYERS  # warm-up step + measured step


def test_gpt_bf16_losses_identical(megatron_mp, with_features):
    (base_loss, base_grads, _, _), (loss, grads, _, _), _ = _gpt_pair(with_features, [FLAG], torch.bfloat16)
    assert loss.dtype == torch.float32 and torch.equal(loss, base_loss)
    for name, g in base_grads.items():
        assert torch.equal(grads[name], g), name


def test_gpt_first_two_layers_only(megatron_mp, with_features):
    (base_loss, base_grads, _, _), (loss, grads, _, _), delta = _gpt_pair(with_features, [FLAG, NUM, "2"])
    assert torch.equal(loss, base_loss)
    assert all(torch.equal(grads[n], g) for n, g in base_grads.items())
    assert delta["freed"] == delta["recomputed"] == 2 * 2


def test_gpt_memory_saved_is_the_activations(megatron_mp, with_features):
    """4 layers, ffn = 4 x hidden: A = layers x tokens x ffn x bytes.

    Held between forward and backward drops by >= 95% of A; the step's peak by >= A / 2."""
    acc = megatron_acc()
    if acc.name == "cpu" and not acc.enable_memory_tracking():
        pytest.skip("tracking allocator unavailable: " + acc.memory_tracking())
    (_, _, base_held, base_peak), (_, _, held, peak), _ = _gpt_pair(with_features, [FLAG])
    a = LAYERS * SEQ * BATCH * 4 * HIDDEN * 4
    assert base_held - held >= 0.95 * a, (base_held, held, a)
    assert base_peak - peak >= 0.5 * a, (base_peak, peak, a)


def test_moe_layers_are_excluded_and_said(megatron_mp, with_features):

    (base_loss, _, _, _), (loss, _, _, _), delta = _gpt_pair(
        with_features, [FLAG], num_moe_experts=2, moe_router_topk=2, add_bias_linear=False,
        moe_token_dispatcher_type="alltoall", moe_ffn_hidden_size=4 * HIDDEN)
    assert torch.equal(loss, base_loss)
    assert delta["freed"] == 0
    assert any("MoE/expert MLPs are not covered" in n for n in with_features.ctx.notes)


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_recompute_keeps_nan_payloads_and_infinities(megatron_mp, with_features, dtype):
    """A non-finite activation is recomputed to the same bits (NaN payloads included), so a
    NaN/Inf reported by Megatron's checks is the one the unpatched model would have produced."""
    from npuspeed.features.recompute_activation.mlp import ATTR

    mlp = _mlp(_config(params_dtype=dtype, **MLP_CASES["gelu+bias"]))
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(6, 3, 32)
    x.view(-1)[[0, 7, 40]] = torch.tensor([float("inf"), float("-inf"), 0.0])
    x.view(torch.int32).view(-1)[[3, 90]] = torch.tensor([0x7FC00123, -0x003FFF01], dtype=torch.int32)  # payloads
    x = x.to(dtype)
    expected = _run_mlp(mlp, x)
    with with_features([FLAG]):
        setattr(mlp, ATTR, True)
        got = _run_mlp(mlp, x)
    assert bool(torch.isnan(expected[0]).any()) and bool(torch.isinf(x.float()).any())
    for a, b in zip(got[:3], expected[:3]):
        assert a is None and b is None or torch.equal(_bits(a), _bits(b))
    for name in expected[3]:
        assert torch.equal(_bits(got[3][name]), _bits(expected[3][name])), name
