"""--use-flash-attn's two patches: DotProductAttention.forward runs the fused kernel (forward.py)
with the band, sparse mode and fallback the flags give; __init__ records what the forward needs."""
from __future__ import annotations

TARGET = "megatron.core.transformer.dot_product_attention.DotProductAttention"
MEGATRON_RANGE = ">=0.12,<0.20"  # forward(query, key, value, attention_mask, attn_mask_type,
# attention_bias, packed_seq_params) is the same in all of them; window_size exists from 0.15;
# dot_product_attention.py is byte-identical 0.16.1 -> 0.19.2 (0.19's extra core-attention
# kwargs go only to custom modules, e.g. DSA's)


def kernel(accelerator) -> str:
    """The fused kernel this accelerator runs: npu_fusion_attention where it has it, else SDPA."""
    from npuspeed.accelerator import for_device

    if for_device(accelerator.name).has_vendor_kernels() and accelerator.has_fused_attention():
        return "npu_fusion_attention"
    return "sdpa"


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.features.fused_attention.candidates import AttentionFallback
    from npuspeed.features.fused_attention.forward import KernelChoice, init_wrapper, make_forward
    from npuspeed.features.fused_attention.masks import BandOptions

    fixed = config.flash_attn_fallback
    choice = KernelChoice(
        kernel=kernel(ctx.accelerator),
        band=BandOptions(config.pre_tockens, config.next_tockens),
        sparse_mode=config.sparse_mode,
        accelerator=ctx.accelerator,
        fallback=AttentionFallback(None if fixed in (None, "auto") else fixed),
    )
    registry.register(f"{TARGET}.forward", make_forward(choice), feature=feature, megatron=MEGATRON_RANGE)
    registry.register(f"{TARGET}.__init__", wrapper=init_wrapper, feature=feature, megatron=MEGATRON_RANGE)
