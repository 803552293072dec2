"""Fused attention (`--use-flash-attn`): Megatron-Core's local core attention on one fused kernel.

Megatron's `DotProductAttention` materialises the S x S scores (baddbmm, masked softmax,
bmm). Under Megatron's own `--use-flash-attn` its forward is replaced: on NPU by
`torch_npu.npu_fusion_attention` (as MindSpeed does, with MindSpeed's `--pre-tockens`,
`--next-tockens`, `--sparse-mode`), elsewhere by `scaled_dot_product_attention`. Masking,
scale, GQA and dropout follow Megatron's module exactly (see masks.py and forward.py).
Only the local spec's `DotProductAttention` is patched (patches.py); Transformer Engine specs
keep TE's.
"""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.fused_attention import patches as _patches, plan as _plan
from npuspeed.ops import flash_attention as cpu_flash

@dataclass(frozen=True)
class Config(FeatureConfig):
    use_flash_attn: bool = flag("--use-flash-attn", False)
    """Run Megatron's core attention on a fused kernel (npu_fusion_attention on NPU,
    scaled_dot_product_attention elsewhere)."""
    pre_tockens: int | None = flag("--pre-tockens", None, type=int)
    """With --use-flash-attn: attend to at most this many earlier tokens (band attention, on
    every backend). Default: unbounded."""
    next_tockens: int | None = flag("--next-tockens", None, type=int)
    """With --use-flash-attn: attend to at most this many later tokens (0 with a causal model).
    Default: unbounded."""
    sparse_mode: int | None = flag("--sparse-mode", None, type=int, choices=[0, 1, 2, 3, 4])
    """With --use-flash-attn on NPU: force npu_fusion_attention's sparse_mode (0 full mask, 1
    all-mask, 2/3 compressed causal, 4 band). Default: chosen per layer (2 causal, 4 band, 0
    explicit mask)."""
    flash_attn_fallback: str | None = flag("--flash-attn-fallback", None, choices=["auto", "sdpa", "unfused"])
    """With --use-flash-attn: for calls no fused kernel takes (on CPU: masks that are not
    per-row key ranges, fp16), run scaled_dot_product_attention or Megatron's unfused forward.
    Default auto: measured once per shape, SDPA only when it is neither slower nor larger."""


def _kernel(accelerator) -> str:
    from npuspeed.features.fused_attention.patches import kernel

    return kernel(accelerator)


class FusedAttentionFeature(Feature, name="fused_attention", Config=Config, patches=_patches, plan=_plan,
                            switch="use_flash_attn",
                            requires={"pre_tockens": "use_flash_attn", "next_tockens": "use_flash_attn",
                                      "sparse_mode": "use_flash_attn", "flash_attn_fallback": "use_flash_attn"}):
    def validate(self, ctx) -> None:
        config, accelerator = self.config(ctx.args), ctx.accelerator
        self.check_requires(config)
        pre, nxt, mode = config.pre_tockens, config.next_tockens, config.sparse_mode
        if pre is not None and nxt is not None and pre + nxt < 0:
            raise FeatureError(f"--pre-tockens {pre} --next-tockens {nxt} leave no token to attend to; "
                               "their sum must be >= 0.")
        if mode in (1, 2, 3) and (pre is not None or nxt is not None):
            raise FeatureError(f"--sparse-mode {mode} ignores --pre-tockens/--next-tockens; "
                               "use --sparse-mode 4 (band) or 0, or drop the token flags.")
        if mode is not None and _kernel(accelerator) != "npu_fusion_attention":
            raise FeatureError(f"--sparse-mode selects npu_fusion_attention's mask mode; on "
                               f"{accelerator.name} there is none. Drop --sparse-mode (the band flags "
                               "--pre-tockens/--next-tockens work on every backend).")

    def prepare(self, ctx) -> None:
        accelerator = ctx.accelerator
        host = for_device(accelerator.name).host_is_device()
        if for_device(accelerator.name).has_vendor_kernels() and not accelerator.has_fused_attention():
            ctx.note("--use-flash-attn: this torch_npu has no npu_fusion_attention; attention runs "
                         "torch's scaled_dot_product_attention on the NPU instead.")
        elif not accelerator.has_fused_attention():
            ctx.note(f"--use-flash-attn: {accelerator.name} has no fused attention kernel; "
                         "scaled_dot_product_attention runs its math backend (S x S scores).")
        reason = cpu_flash.machine_reason() if host and ctx.megatron.bf16 else None
        if reason:
            instead = ("npuspeed's portable fp32 kernel on fp32 copies of q/k/v" if cpu_flash.fp32_reason() is None
                       else "scaled_dot_product_attention or Megatron's unfused path (measured)")
            ctx.note(f"--use-flash-attn: bf16 attention runs {instead}, not npuspeed's bf16 CPU kernel: {reason}.")
        fp32 = cpu_flash.fp32_reason() if host else None
        if fp32:
            ctx.note("--use-flash-attn: fp32 attention runs scaled_dot_product_attention or Megatron's "
                     f"unfused path (measured), not npuspeed's fp32 CPU kernel: {fp32}.")

    def check_built(self, block, ctx) -> str | None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        if any(isinstance(m, DotProductAttention) for m in block.modules()):
            return None
        kinds = sorted({type(m).__name__ for m in block.modules() if "Attention" in type(m).__name__})
        return ("--use-flash-attn replaces Megatron-Core's local DotProductAttention, and this block has "
                f"none (attention modules: {', '.join(kinds) or 'none'}; a Transformer Engine spec keeps "
                "TE's own kernel): build the model with the local spec (--transformer-impl local) or "
                "drop --use-flash-attn")

    def running(self, ctx) -> str:
        config, accelerator = self.config(ctx.args), ctx.accelerator
        band = ""
        if config.pre_tockens is not None or config.next_tockens is not None:
            band = f"; band pre_tockens={config.pre_tockens} next_tockens={config.next_tockens}"
        if _kernel(accelerator) == "npu_fusion_attention":
            mode = "auto (2 causal, 4 band, 0 mask)" if config.sparse_mode is None else str(config.sparse_mode)
            return (f"torch_npu.npu_fusion_attention (SBH, sparse_mode {mode}{band}) replaces "
                    "DotProductAttention.forward: --use-flash-attn on an NPU with the fused kernel")
        kind = "fused kernel" if accelerator.has_fused_attention() else "math backend, no fused kernel here"
        sdpa = f"scaled_dot_product_attention ({kind}; is_causal, enable_gqa, boolean masks"
        if not for_device(accelerator.name).host_is_device():
            return f"{sdpa}{band}) replaces DotProductAttention.forward: --use-flash-attn on {accelerator.name}"
        reason, fp32 = cpu_flash.machine_reason(), cpu_flash.fp32_reason()
        kernels = [("bf16: npuspeed::flash_attention (AVX512-BF16 tiles)" if reason is None
                    else f"bf16: npuspeed's kernel unavailable: {reason}"),
                   ("fp32: npuspeed::flash_attention_fp32 (portable at::vec)" if fp32 is None
                    else f"fp32: npuspeed's kernel unavailable: {fp32}")]
        fixed = config.flash_attn_fallback or "auto"
        how = "measured once per shape" if fixed == "auto" else f"--flash-attn-fallback {fixed}"
        return (f"npuspeed's CPU flash kernels replace DotProductAttention.forward (--use-flash-attn on cpu): "
                f"{'; '.join(kernels)}; causal, padding, bands and interval masks as per-row key ranges{band}, "
                f"dropout in the kernel; other calls: {sdpa}) or Megatron's unfused forward, {how}")
