"""Fused RoPE (`--use-fused-rotary-pos-emb`): Megatron's unfused rotary position embedding runs
the fastest correct rotary_pos_emb for its shape (npuspeed.ops.fused_choice; rope.py), and where
npuspeed's Triton kernel runs, an attention's q and k go in one launch (rope_qk.py). What the
three fused ops share: features/fused_op_base.py."""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.accelerator import npu_ops
from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import FeatureError
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.fused_rotary_pos_emb import patches as _patches, plan as _plan
from npuspeed.features.fused_op_base import FusedOpFeature

FLAG = "--use-fused-rotary-pos-emb"


@dataclass(frozen=True)
class Config(FeatureConfig):
    use_fused_rotary_pos_emb: bool = flag(FLAG, False)
    """Run Megatron's unfused rotary position embedding (--position-embedding-type rope) on the
    fastest correct rotary_pos_emb here, measured once per shape (fwd+bwd) among npuspeed's kernel
    (CPU: C++ csrc/cpu/rope.cpp; CUDA/NPU: Triton), the device's native op (NPU:
    torch_npu.npu_rotary_mul) and Megatron's own path (never slower than the flag off).
    NPUSPEED_FUSED_OP_PATH=cpp|triton|npu|native|megatron forces one."""


class FusedRotaryPosEmbFeature(FusedOpFeature, name="fused_rotary_pos_emb", Config=Config, patches=_patches,
                               plan=_plan, switch="use_fused_rotary_pos_emb", fused=_plan.FUSED,
                               npu_kernel=npu_ops.ROTARY_MUL, source="csrc/cpu/rope.cpp", triton_module="rope",
                               megatron_path="_apply_rotary_pos_emb_bshd"):
    def candidates(self, accelerator) -> list[str]:
        found = super().candidates(accelerator)
        triton = any(c.startswith("npuspeed Triton kernel") for c in found)
        if triton and not for_device(accelerator.name).host_is_device():
            found.insert(-1, "an attention's q and k in one Triton launch (rotary_pos_emb_qk, against the "
                             "one-tensor paths twice and Megatron's)")
        return found

    def validate(self, ctx) -> None:
        kind = ctx.megatron.position_embedding_type
        if kind in ("learned_absolute", "none"):  # rope, yarn, mrope rotate
            raise FeatureError(f"{FLAG} fuses rotary embeddings, but --position-embedding-type is {kind}: "
                               f"use --position-embedding-type rope or drop {FLAG}")
