"""Fused RMSNorm, SwiGLU and RoPE (`--use-fused-rmsnorm`, `--use-fused-swiglu`,
`--use-fused-rotary-pos-emb`): one feature per flag, each routing one Megatron-Core
computation to an `npuspeed.ops` front end (C++ on CPU, torch_npu on NPU, reference else)."""
from __future__ import annotations

from npuspeed import telemetry
from npuspeed.features.base import FeatureError
from npuspeed.features.fused_ops import rmsnorm, rope, swiglu
from npuspeed.features.fused_ops.base import FusedOpFeature


class FusedRMSNormFeature(FusedOpFeature):
    name = "fused_rmsnorm"
    flags = ("--use-fused-rmsnorm",)
    op, npu_kernel, source = "rms_norm", "npu_rms_norm", "csrc/cpu/rms_norm.cpp"
    replaces = "the torch.nn.RMSNorm of --normalization RMSNorm"
    patches = rmsnorm

    def validate(self, ctx) -> None:
        norm = ctx.megatron.normalization
        if norm is not None and norm != "RMSNorm":
            raise FeatureError(f"--use-fused-rmsnorm fuses RMSNorm, but --normalization is {norm}: "
                               "use --normalization RMSNorm or drop --use-fused-rmsnorm")

    def path(self, ctx) -> str:
        base = super().path(ctx)
        return base if base == "off" else f"{base}; {telemetry.get(rmsnorm.SWAPPED)} norms fused"


class FusedSwiGLUFeature(FusedOpFeature):
    name = "fused_swiglu"
    flags = ("--use-fused-swiglu",)
    op, npu_kernel, source = "swiglu", "npu_swiglu", "csrc/cpu/swiglu.cpp"
    replaces = "the SwiGLU activation of the MLP (--swiglu)"
    patches = swiglu


class FusedRoPEFeature(FusedOpFeature):
    name = "fused_rotary_pos_emb"
    flags = ("--use-fused-rotary-pos-emb",)
    op, npu_kernel, source = "rotary_pos_emb", "npu_rotary_mul", "csrc/cpu/rope.cpp"
    replaces = "Megatron's unfused rotary position embedding (--position-embedding-type rope)"
    patches = rope

    def validate(self, ctx) -> None:
        kind = ctx.megatron.position_embedding_type
        if kind in ("learned_absolute", "none"):  # rope, yarn, mrope rotate
            raise FeatureError(f"--use-fused-rotary-pos-emb fuses rotary embeddings, but "
                               f"--position-embedding-type is {kind}: use --position-embedding-type "
                               "rope or drop --use-fused-rotary-pos-emb")


FEATURES = (FusedRMSNormFeature, FusedSwiGLUFeature, FusedRoPEFeature)
