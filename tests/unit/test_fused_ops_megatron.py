"""The fused-op features inside Megatron-Core: each patch against unpatched Megatron, on one
gloo rank. Same weights and inputs with and without the flag; fp32 outputs and gradients
must agree (<= 1e-5; RoPE bit for bit) and the call tally must show the C++ kernels ran.
The chooser is forced to the C++ kernels here (NPUSPEED_FUSED_OP_PATH=cpp): these tests are
about the kernels inside Megatron; the measured choice has its own tests (test_fused_choice*)."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from npuspeed import telemetry
from npuspeed.ops import _dispatch
from npuspeed.ops._extension import has_op

pytestmark = pytest.mark.skipif(not has_op("rms_norm"), reason="C++ op library not built")
FLAGS = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb"]


@pytest.fixture(autouse=True)
def _fresh_tally(monkeypatch):
    monkeypatch.setenv("NPUSPEED_FUSED_OP_PATH", "cpp")
    _dispatch.reset_calls()


def _config(**kw):
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def _run(module, *inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = module(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)))
    params = dict(module.named_parameters()) if isinstance(module, torch.nn.Module) else {}
    grads = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
    for p in params.values():
        p.grad = None
    return out.detach(), [t.grad for t in leaves], grads


def _assert_same(a, b, tol=1e-5):
    out_a, in_a, par_a = a
    out_b, in_b, par_b = b
    torch.testing.assert_close(out_a, out_b, rtol=tol, atol=tol)
    for x, y in zip(in_a, in_b):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)
    assert par_a.keys() == par_b.keys()
    for name in par_a:
        torch.testing.assert_close(par_a[name], par_b[name], rtol=tol, atol=tol, msg=name)


# -- RMSNorm -----------------------------------------------------------------------------------
def test_rmsnorm_is_fused_and_keeps_sequence_parallel_marks(npuspeed_runtime, with_features):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from npuspeed.features.fused_rmsnorm.rmsnorm import FusedRMSNorm

    config = _config(normalization="RMSNorm", tensor_model_parallel_size=2, sequence_parallel=True,
                     layernorm_epsilon=1e-6)
    plain = WrappedTorchNorm(config, 32, eps=1e-6)
    assert type(plain) is torch.nn.RMSNorm
    with with_features(["--use-fused-rmsnorm"]):
        fused = WrappedTorchNorm(config, 32, eps=1e-6)
        layer_norm = WrappedTorchNorm(_config(normalization="LayerNorm"), 32)
    assert type(fused) is FusedRMSNorm and isinstance(fused, torch.nn.RMSNorm)
    assert type(layer_norm) is torch.nn.LayerNorm
    assert all(getattr(p, "sequence_parallel", False) for p in fused.parameters())
    assert type(WrappedTorchNorm(config, 32)) is torch.nn.RMSNorm  # reverted with the feature
    with torch.no_grad():
        plain.weight.normal_()
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(6, 2, 32)
    _assert_same(_run(fused, x), _run(plain, x))
    assert _dispatch.calls().get(("rms_norm", "cpp"), 0) == 1


# -- SwiGLU ------------------------------------------------------------------------------------
def _mlp(config):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    return MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fusion", [False, True])
def test_swiglu_mlp_matches_unfused_megatron(megatron_mp, with_features, bias, fusion):
    from npuspeed.features.fused_swiglu import swiglu as feature

    kw = dict(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=bias)
    baseline = _mlp(_config(**kw, bias_activation_fusion=False))  # Megatron's inline GLU
    with torch.no_grad():
        for p in baseline.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(5, 2, 32)
    expected = _run(baseline, x)
    routed_before = telemetry.get(feature.ROUTED)
    with with_features(["--use-fused-swiglu"]):
        mlp = _mlp(_config(**kw, bias_activation_fusion=fusion))
        mlp.load_state_dict(baseline.state_dict())
        got = _run(mlp, x)
    _assert_same(got, expected)
    assert _dispatch.calls().get(("swiglu", "cpp"), 0) == 1
    # Without the fusion flag the MLP was routed through a private config copy.
    assert telemetry.get(feature.ROUTED) - routed_before == (0 if fusion else 1)
    assert mlp.config.bias_activation_fusion is True


def test_swiglu_leaves_other_activations_alone(megatron_mp, with_features):
    with with_features(["--use-fused-swiglu"]):
        gelu = _mlp(_config(gated_linear_unit=False, activation_func=F.gelu))
        gelu(torch.randn(3, 1, 32))
    assert gelu.config.bias_activation_fusion is False
    assert _dispatch.calls().get(("swiglu", "cpp"), 0) == 0


# -- RoPE --------------------------------------------------------------------------------------
def _freqs(s, dim, rotary_percent=1.0, interleaved=False):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(dim, rotary_percent, rotary_interleaved=interleaved, use_cpu_initialization=True)
    return rope(s)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_rope_matches_megatron_bitwise(megatron_mp, with_features, interleaved, rotary_percent):
    from megatron.core.models.common.embeddings import rope_utils

    config = _config(rotary_interleaved=interleaved)
    t = torch.randn(7, 2, 4, 16)
    freqs = _freqs(7, 16, rotary_percent, interleaved)
    expected = _run(lambda t: rope_utils.apply_rotary_pos_emb(t, freqs, config), t)
    with with_features(["--use-fused-rotary-pos-emb"]):
        got = _run(lambda t: rope_utils.apply_rotary_pos_emb(t, freqs, config), t)
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1][0], expected[1][0], rtol=1e-6, atol=1e-6)
    assert _dispatch.calls().get(("rotary_pos_emb", "cpp"), 0) == 1


def test_rope_packed_thd_sequences(megatron_mp, with_features):
    from megatron.core.models.common.embeddings import rope_utils

    config = _config()
    cu_seqlens = torch.tensor([0, 3, 8], dtype=torch.int32)
    t = torch.randn(8, 4, 16)
    freqs = _freqs(8, 16)
    expected = _run(lambda t: rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens), t)
    with with_features(["--use-fused-rotary-pos-emb"]):
        got = _run(lambda t: rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens), t)
    assert torch.equal(got[0], expected[0])
    assert _dispatch.calls().get(("rotary_pos_emb", "cpp"), 0) >= 1  # one call (0.16 packs) or one per sequence


def test_rope_multi_latent_attention_goes_to_megatron(megatron_mp, with_features):
    from megatron.core.models.common.embeddings import rope_utils

    t, freqs = torch.randn(5, 1, 2, 8), _freqs(5, 8)
    expected = rope_utils._apply_rotary_pos_emb_bshd(t, freqs, multi_latent_attention=True)
    with with_features(["--use-fused-rotary-pos-emb"]):
        got = rope_utils._apply_rotary_pos_emb_bshd(t, freqs, multi_latent_attention=True)
    assert torch.equal(got, expected)
    assert _dispatch.calls().get(("rotary_pos_emb", "cpp"), 0) == 0


def _mla_keywords():
    import inspect

    from megatron.core.models.common.embeddings import rope_utils

    return [k for k in ("mla_rotary_interleaved", "multi_latent_attention")
            if k in inspect.signature(rope_utils._apply_rotary_pos_emb_bshd).parameters]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_rope_mla_keyword_of_each_release(megatron_mp, with_features):
    """0.19 renamed the MLA reorder to mla_rotary_interleaved (multi_latent_attention: a deprecated
    alias): False under either name runs the fused op, True Megatron's; nothing else falls back."""
    from megatron.core.models.common.embeddings import rope_utils

    t, freqs = torch.randn(5, 1, 2, 8), _freqs(5, 8)
    for name in _mla_keywords():
        for mla in (False, True):
            expected = rope_utils._apply_rotary_pos_emb_bshd(t, freqs, **{name: mla})
            _dispatch.reset_calls()
            with with_features(["--use-fused-rotary-pos-emb"]):
                got = rope_utils._apply_rotary_pos_emb_bshd(t, freqs, **{name: mla})
            assert torch.equal(got, expected), (name, mla)
            assert _dispatch.calls().get(("rotary_pos_emb", "cpp"), 0) == (0 if mla else 1), (name, mla)


def test_rope_refuses_a_release_with_an_unknown_keyword():
    from npuspeed.features.base import FeatureError
    from npuspeed.features.fused_rotary_pos_emb import rope

    def newer(t, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0, yarn_mode=None):
        return t

    with pytest.raises(FeatureError, match="--use-fused-rotary-pos-emb: megatron-core .* takes yarn_mode"):
        rope.fused_bshd(newer)


# -- all three in a Llama-style GPT ------------------------------------------------------------
def _gpt(config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=64,
                    max_sequence_length=16, position_embedding_type="rope")


def test_llama_style_gpt_with_all_three_flags(megatron_mp, with_features):
    from megatron.core import tensor_parallel

    config = _config(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                     add_bias_linear=False, bias_activation_fusion=False, apply_rope_fusion=False)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(16).expand(2, 16)
    labels = torch.roll(tokens, -1, 1)

    def loss_and_grads(model):
        loss = model(tokens, position_ids, None, labels=labels).float().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads

    tensor_parallel.model_parallel_cuda_manual_seed(7)
    torch.manual_seed(7)
    baseline = _gpt(config)
    base_loss, base_grads = loss_and_grads(baseline)
    assert sum(_dispatch.calls().values()) == 0
    with with_features(FLAGS):
        model = _gpt(config)
        model.load_state_dict(baseline.state_dict())
        loss, grads = loss_and_grads(model)
    assert abs(loss.item() - base_loss.item()) <= 1e-5
    for name, g in base_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=name)
    # 2 layers x 2 norms + final norm; 2 MLPs; q and k per layer.
    assert _dispatch.calls() == {("rms_norm", "cpp"): 5, ("swiglu", "cpp"): 2, ("rotary_pos_emb", "cpp"): 4}


def test_report_paths(npuspeed_runtime):
    from feature_ctx import ctx_for

    from npuspeed.features import all_features

    ctx = ctx_for(FLAGS)
    paths = {f.name: f.path(ctx) for f in all_features()}
    assert "npuspeed::rms_norm (C++ csrc/cpu/rms_norm.cpp" in paths["fused_rmsnorm"]
    assert "npuspeed::swiglu (C++" in paths["fused_swiglu"]
    assert "npuspeed::rotary_pos_emb (C++" in paths["fused_rotary_pos_emb"]
    assert all("Megatron's path" in paths[n] and "measured once per shape" in paths[n]
               for n in ("fused_rmsnorm", "fused_swiglu", "fused_rotary_pos_emb"))
    off = ctx_for([])
    assert all(f.path(off) == "off" for f in all_features()
               if f.name.startswith("fused_") and f.name != "fused_attention")


def test_bias_swiglu_options_keep_megatrons_kernel():
    from npuspeed.features.fused_swiglu.swiglu import fused_bias_swiglu

    seen = []

    def megatron_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
        seen.append((fp8_input_store, cpu_offload_input))
        return input

    patched = fused_bias_swiglu(megatron_impl)
    x, bias = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(patched(x, bias, False, False), F.silu((x + bias)[:, :4]) * (x + bias)[:, 4:])
    assert seen == [] and _dispatch.calls().get(("swiglu", "cpp"), 0) == 1
    patched(x, bias, True)
    patched(x, None, False, cpu_offload_input=True)
    assert seen == [(True, False), (False, True)]
