"""Fused attention (`--use-flash-attn`): Megatron-Core's local core attention on one fused kernel.

Megatron's `DotProductAttention` materialises the S x S scores (baddbmm, masked softmax,
bmm). Under Megatron's own `--use-flash-attn` its forward is replaced: on NPU by
`torch_npu.npu_fusion_attention` (as MindSpeed does, with MindSpeed's `--pre-tockens`,
`--next-tockens`, `--sparse-mode`), elsewhere by `scaled_dot_product_attention`. Masking,
scale, GQA and dropout follow Megatron's module exactly (see plan.py and forward.py).
Only the local spec's `DotProductAttention` is patched; Transformer Engine specs keep TE's.
"""
from __future__ import annotations

import argparse

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.fused_attention.fallback import AttentionFallback
from npuspeed.features.fused_attention.forward import KernelChoice, init_wrapper, kernel_calls, make_forward
from npuspeed.features.fused_attention.plan import BandOptions
from npuspeed.ops import flash_attention as cpu_flash

TARGET = "megatron.core.transformer.dot_product_attention.DotProductAttention"
MEGATRON_RANGE = ">=0.12,<0.20"  # forward(query, key, value, attention_mask, attn_mask_type,
# attention_bias, packed_seq_params) is the same in all of them; window_size exists from 0.15;
# dot_product_attention.py is byte-identical 0.16.1 -> 0.19.2 (0.19's extra core-attention
# kwargs go only to custom modules, e.g. DSA's)


class FusedAttentionFeature(Feature):
    name = "fused_attention"
    flags = ("--use-flash-attn", "--pre-tockens", "--next-tockens", "--sparse-mode", "--flash-attn-fallback")

    def add_arguments(self, group) -> None:
        group.add_argument("--use-flash-attn", action="store_true",
                           help="Run Megatron's core attention on a fused kernel "
                                "(npu_fusion_attention on NPU, scaled_dot_product_attention elsewhere).")
        group.add_argument("--pre-tockens", type=int, default=None,
                           help="With --use-flash-attn: attend to at most this many earlier tokens "
                                "(band attention, on every backend). Default: unbounded.")
        group.add_argument("--next-tockens", type=int, default=None,
                           help="With --use-flash-attn: attend to at most this many later tokens "
                                "(0 with a causal model). Default: unbounded.")
        group.add_argument("--sparse-mode", type=int, default=None, choices=[0, 1, 2, 3, 4],
                           help="With --use-flash-attn on NPU: force npu_fusion_attention's sparse_mode "
                                "(0 full mask, 1 all-mask, 2/3 compressed causal, 4 band). Default: chosen "
                                "per layer (2 causal, 4 band, 0 explicit mask).")
        group.add_argument("--flash-attn-fallback", choices=["auto", "sdpa", "unfused"], default=None,
                           help="With --use-flash-attn: for calls no fused kernel takes (on CPU: masks that "
                                "are not per-row key ranges, fp16), run scaled_dot_product_attention or "
                                "Megatron's unfused forward. Default auto: measured once per shape, SDPA only "
                                "when it is neither slower nor larger.")

    def enabled(self, args: argparse.Namespace) -> bool:
        # The tuning flags alone turn the feature on, so validate() can refuse them.
        return bool(getattr(args, "use_flash_attn", False)) or any(
            getattr(args, a, None) is not None
            for a in ("pre_tockens", "next_tockens", "sparse_mode", "flash_attn_fallback")
        )

    def validate(self, ctx) -> None:
        args, accelerator = ctx.args, ctx.accelerator
        given = [f for f, a in (("--pre-tockens", "pre_tockens"), ("--next-tockens", "next_tockens"),
                                ("--sparse-mode", "sparse_mode"), ("--flash-attn-fallback", "flash_attn_fallback"))
                 if getattr(args, a, None) is not None]
        if not getattr(args, "use_flash_attn", False):
            raise FeatureError(f"{', '.join(given)} only apply to fused attention: add --use-flash-attn "
                               "or drop them.")
        pre, nxt = args.pre_tockens, args.next_tockens
        if pre is not None and nxt is not None and pre + nxt < 0:
            raise FeatureError(f"--pre-tockens {pre} --next-tockens {nxt} leave no token to attend to; "
                               "their sum must be >= 0.")
        if args.sparse_mode in (1, 2, 3) and (pre is not None or nxt is not None):
            raise FeatureError(f"--sparse-mode {args.sparse_mode} ignores --pre-tockens/--next-tockens; "
                               "use --sparse-mode 4 (band) or 0, or drop the token flags.")
        if args.sparse_mode is not None and self._kernel(accelerator) != "npu_fusion_attention":
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

    @staticmethod
    def _kernel(accelerator) -> str:
        if for_device(accelerator.name).has_vendor_kernels() and accelerator.has_fused_attention():
            return "npu_fusion_attention"
        return "sdpa"

    def register_patches(self, registry, ctx) -> None:
        args, accelerator = ctx.args, ctx.accelerator
        fixed = getattr(args, "flash_attn_fallback", None)
        choice = KernelChoice(
            kernel=self._kernel(accelerator),
            band=BandOptions(args.pre_tockens, args.next_tockens),
            sparse_mode=args.sparse_mode,
            accelerator=accelerator,
            fallback=AttentionFallback(None if fixed in (None, "auto") else fixed),
        )
        registry.register(f"{TARGET}.forward", make_forward(choice), feature=self.name, megatron=MEGATRON_RANGE)
        registry.register(f"{TARGET}.__init__", wrapper=init_wrapper, feature=self.name, megatron=MEGATRON_RANGE)

    def check_built(self, block, ctx) -> str | None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        if any(isinstance(m, DotProductAttention) for m in block.modules()):
            return None
        kinds = sorted({type(m).__name__ for m in block.modules() if "Attention" in type(m).__name__})
        return ("--use-flash-attn replaces Megatron-Core's local DotProductAttention, and this block has "
                f"none (attention modules: {', '.join(kinds) or 'none'}; a Transformer Engine spec keeps "
                "TE's own kernel): build the model with the local spec (--transformer-impl local) or "
                "drop --use-flash-attn")

    def plan_effect(self, model, ctx):
        from npuspeed.features.base import PlanEffect

        if model.layout.cp > 1:
            return None  # every call goes to context parallelism, whose plan effect states it
        flash = PlanEffect(
            variants={"core_attention": "flash"}, kernels={"attention": "flash"},
            summary="no S x S tensors: the score buffer, softmax, dropout mask and dropped probabilities "
                    "of every layer go; q, k, v, the output and a [b, heads, s] log-sum-exp stay")
        if not for_device(ctx.accelerator.name).host_is_device():
            return flash
        bf16 = model.batch.dtype == "bf16"
        reason = cpu_flash.machine_reason() if bf16 else cpu_flash.fp32_reason()
        if reason is None and bf16 and model.model.kv_channels % 16:
            reason = f"head dim {model.model.kv_channels} is not a multiple of 16"
        if reason is None or model.model.attention_dropout <= 0:
            return flash  # npuspeed's CPU kernels (dropout inside), or SDPA's flash kernel
        return PlanEffect(
            variants={"core_attention": "sdpa_math"}, kernels={"attention": "sdpa_math"},
            summary=f"npuspeed's CPU kernel cannot run here ({reason}) and scaled_dot_product_attention "
                    "with dropout runs torch's math backend: the S x S softmax, mask and dropped "
                    "probabilities stay, in fp32 with fp32 copies of q, k, v")

    def path(self, ctx) -> str:
        args, accelerator = ctx.args, ctx.accelerator
        band = ""
        if args.pre_tockens is not None or args.next_tockens is not None:
            band = f"; band pre_tockens={args.pre_tockens} next_tockens={args.next_tockens}"
        if self._kernel(accelerator) == "npu_fusion_attention":
            mode = "auto (2 causal, 4 band, 0 mask)" if args.sparse_mode is None else str(args.sparse_mode)
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
        fixed = getattr(args, "flash_attn_fallback", None) or "auto"
        how = "measured once per shape" if fixed == "auto" else f"--flash-attn-fallback {fixed}"
        text = (f"npuspeed's CPU flash kernels replace DotProductAttention.forward (--use-flash-attn on cpu): "
                f"{'; '.join(kernels)}; causal, padding, bands and interval masks as per-row key ranges{band}, "
                f"dropout in the kernel; other calls: {sdpa}) or Megatron's unfused forward, {how}")
        return text


__all__ = ["FusedAttentionFeature", "kernel_calls"]
