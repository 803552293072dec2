"""Fused RMSNorm, SwiGLU and RoPE (`--use-fused-rmsnorm`, `--use-fused-swiglu`,
`--use-fused-rotary-pos-emb`): one feature per flag, each routing one Megatron-Core
computation to the fastest correct implementation for its shape (npuspeed.ops.fused_choice:
npuspeed's C++/Triton kernel, the device's native op, or Megatron's own path, measured once)."""
from __future__ import annotations

from npuspeed import telemetry
from npuspeed.accelerator import npu_ops
from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import FeatureError
from npuspeed.features.fused_ops import rmsnorm, rope, swiglu
from npuspeed.features.fused_ops.base import FusedOpFeature


class FusedRMSNormFeature(FusedOpFeature):
    name = "fused_rmsnorm"
    flags = ("--use-fused-rmsnorm",)
    op, npu_kernel, source = "rms_norm", npu_ops.RMS_NORM, "csrc/cpu/rms_norm.cpp"
    replaces = "the torch.nn.RMSNorm of --normalization RMSNorm"
    patches = rmsnorm
    triton_module, megatron_path = "rms_norm", "torch.nn.RMSNorm: F.rms_norm, torch's native op"
    plan_slot, plan_saves = "norm", "saves the input and an fp32 rstd, not x * rstd"

    def plan_applies(self, model) -> bool:
        return model.normalization == "RMSNorm"

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
    op, npu_kernel, source = "swiglu", npu_ops.SWIGLU, "csrc/cpu/swiglu.cpp"
    replaces = "the SwiGLU activation of the MLP (--swiglu)"
    patches = swiglu
    triton_module, megatron_path = "swiglu", "eager silu(gate) * up, or bias_swiglu_impl"
    plan_slot, plan_saves = "glu", "saves fc1's output only, not silu(gate) and its product"

    def plan_applies(self, model) -> bool:
        return model.swiglu


class FusedRoPEFeature(FusedOpFeature):
    name = "fused_rotary_pos_emb"
    flags = ("--use-fused-rotary-pos-emb",)
    op, npu_kernel, source = "rotary_pos_emb", npu_ops.ROTARY_MUL, "csrc/cpu/rope.cpp"
    replaces = "Megatron's unfused rotary position embedding (--position-embedding-type rope)"
    patches = rope
    triton_module, megatron_path = "rope", "_apply_rotary_pos_emb_bshd"
    plan_slot, plan_saves = "rope", "no per-call cos/sin tensors saved"

    def plan_applies(self, model) -> bool:
        return model.position_embedding == "rope"

    def candidates(self, accelerator) -> list[str]:
        found = super().candidates(accelerator)
        if not for_device(accelerator.name).host_is_device() and any(c.startswith("npuspeed Triton kernel") for c in found):
            found.insert(-1, "an attention's q and k in one Triton launch (rotary_pos_emb_qk, against the "
                             "one-tensor paths twice and Megatron's)")
        return found

    def validate(self, ctx) -> None:
        kind = ctx.megatron.position_embedding_type
        if kind in ("learned_absolute", "none"):  # rope, yarn, mrope rotate
            raise FeatureError(f"--use-fused-rotary-pos-emb fuses rotary embeddings, but "
                               f"--position-embedding-type is {kind}: use --position-embedding-type "
                               "rope or drop --use-fused-rotary-pos-emb")


FEATURES = (FusedRMSNormFeature, FusedSwiGLUFeature, FusedRoPEFeature)
