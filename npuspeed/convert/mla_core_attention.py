"""Megatron's local DotProductAttention for multi-latent attention.

megatron-core 0.12-0.19 build MLA's core attention with `k_channels` (query/key head size,
qk_head_dim + qk_pos_emb_head_dim) and `v_channels` (v_head_dim), which only Transformer
Engine's attention takes: the local spec's DotProductAttention rejects them, so
`get_gpt_layer_local_spec(multi_latent_attention=True)` does not build. Its forward needs one
change for heads whose value size differs from kv_channels, the width of its output
(heads x v_channels); MLA passes its own softmax scale. This subclass takes both arguments
and sets that width; `local_mla_spec` puts it into a block spec's MLA layers.

megatron-core 0.16 has a second obstacle without Transformer Engine: its MLA constructor asks
`isinstance(linear_proj, TELinear)` whenever the TE import did not fail, and without TE that
import gives a MagicMock, not a class, so the check raises. `buildable` sets the module's
HAVE_TE to False while a model is built, only where TELinear is not a class (the check is
about TE's fp8 input saving, which a local-spec model never uses), and restores it after.
"""
from __future__ import annotations

import contextlib
import math


@contextlib.contextmanager
def buildable():
    """Build MLA layers on a megatron-core whose TE placeholders break the constructor."""
    from megatron.core.transformer import multi_latent_attention as mla

    broken = bool(getattr(mla, "HAVE_TE", False)) and not isinstance(getattr(mla, "TELinear", None), type)
    if broken:
        mla.HAVE_TE = False
    try:
        yield
    finally:
        if broken:
            mla.HAVE_TE = True


def core_attention_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        """DotProductAttention with MLA's separate query/key and value head sizes."""

        def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None,
                     softmax_scale: float | None = None, **kwargs):
            if softmax_scale is None and k_channels is not None:
                softmax_scale = 1.0 / math.sqrt(k_channels)
            super().__init__(*args, softmax_scale=softmax_scale, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
                self.hidden_size_per_attention_head = v_channels

    return MLADotProductAttention


def local_mla_spec(block_spec):
    """`block_spec` (a TransformerBlockSubmodules of the local spec) with every MLA layer's
    core attention this module's class; other layers unchanged."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    cls = core_attention_class()
    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention
        if getattr(attention, "module", None) is MLASelfAttention:
            attention.submodules.core_attention = cls
    return block_spec
