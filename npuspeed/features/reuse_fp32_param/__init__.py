"""`--reuse-fp32-param`: bf16 parameters and their fp32 masters share memory, exactly.

Ordinary bf16 mixed precision keeps each weight twice (2 + 4 bytes). Here the fp32 master
is the bf16 parameter plus a 16-bit residual (2 + 2 bytes, plus a sparse list of exact
ties), rebuilt bit for bit for each optimizer step and for checkpoints. Losses are
bitwise those of ordinary mixed precision. With the distributed optimizer the saving is
2 bytes per parameter / DP. Upstream Transformer Engine's `store_param_remainders` does
the same for TE's fused Adam only; without TE (CPU, NPU) this is the path.
"""
from __future__ import annotations

from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.reuse_fp32_param import patches


class ReuseFp32ParamFeature(Feature):
    name = "reuse_fp32_param"
    flags = ("--reuse-fp32-param",)

    def add_arguments(self, group) -> None:
        group.add_argument("--reuse-fp32-param", action="store_true",
                           help="Share fp32 master weights with bf16 parameters (needs --bf16); "
                                "bitwise-equal training, 2 bytes/parameter less.")

    def enabled(self, args) -> bool:
        return bool(getattr(args, "reuse_fp32_param", False))

    def validate(self, ctx) -> None:
        if ctx.megatron.fp16:
            raise FeatureError("--reuse-fp32-param works with --bf16 only (bf16 is the top half of "
                               "fp32; fp16 is not): replace --fp16 with --bf16 or drop the flag")

    def register_patches(self, registry, ctx) -> None:
        patches.register(registry, self.name)

    def path(self, ctx) -> str:
        from npuspeed.ops._extension import has_op

        codec = "C++ npuspeed::fp32_split/fp32_merge" if has_op("fp32_split") else "pure-PyTorch codec"
        return f"bf16 param + int16 residual + sparse tie list; masters rebuilt per step ({codec})"
