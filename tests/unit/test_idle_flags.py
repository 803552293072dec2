"""A feature flag whose patched module the model never builds is an error, not a silent no-op.

Each case builds a real megatron.core TransformerBlock (local spec) that gives the flag
nothing to do, and expects a FeatureError at model build naming the flag and what it needs;
the matching model with the flag builds fine (so the check cannot just always fire).
"""
from __future__ import annotations

import pytest
import torch.nn.functional as F

from npuspeed.features import FeatureError


def _block(**kw):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlock

    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                add_bias_linear=False)
    spec_kw = {"normalization": kw.get("normalization", "LayerNorm")}
    base.update(kw)
    return TransformerBlock(TransformerConfig(**base), get_gpt_layer_local_spec(**spec_kw))


SWIGLU = dict(gated_linear_unit=True, activation_func=F.silu)


@pytest.mark.parametrize("flag, idle, busy, needle", [
    ("--use-fused-rmsnorm", {}, {"normalization": "RMSNorm"}, "needs RMSNorm"),
    ("--use-fused-swiglu", {}, SWIGLU, r"needs a gated SiLU MLP \(--swiglu\)"),
])
def test_idle_fused_op_flag_is_an_error_at_model_build(megatron_mp, with_features, flag, idle, busy, needle):
    with with_features([flag]):
        with pytest.raises(FeatureError, match=f"{flag}: {needle}"):
            _block(**idle)
        _block(**busy)


def test_flash_attention_without_local_core_attention_is_an_error(megatron_mp, with_features):
    """A spec whose core attention is not Megatron's local DotProductAttention (as under TE)."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlock

    class ForeignCoreAttention(torch.nn.Module):  # stands in for TE's DotProductAttention
        def __init__(self, *args, **kwargs):
            super().__init__()

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = ForeignCoreAttention
    with with_features(["--use-flash-attn"]):
        with pytest.raises(FeatureError, match="--use-flash-attn replaces .*local DotProductAttention.*"
                                               "ForeignCoreAttention"):
            TransformerBlock(config, spec)
        TransformerBlock(config, get_gpt_layer_local_spec())


def test_checks_go_with_the_features(megatron_mp, with_features):
    """No check is left installed once the features are off."""
    from npuspeed.features import build_check
    from npuspeed.patching import registry

    with with_features(["--use-fused-rmsnorm"]):
        assert registry.patches(build_check.NAME)
    assert not registry.patches(build_check.NAME)
    _block()  # LayerNorm, no flag: fine
