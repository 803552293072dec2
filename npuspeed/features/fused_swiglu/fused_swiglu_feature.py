"""Fused SwiGLU (`--use-fused-swiglu`, see swiglu.py): the MLP's SwiGLU activation runs the
fastest correct swiglu for its shape (npuspeed.ops.fused_choice); shared parts: fused_op_base.py."""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.accelerator import npu_ops
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.fused_swiglu import patches as _patches, plan as _plan
from npuspeed.features.fused_op_base import FusedOpFeature
from npuspeed.features.fused_swiglu import swiglu

FLAG = "--use-fused-swiglu"


@dataclass(frozen=True)
class Config(FeatureConfig):
    use_fused_swiglu: bool = flag(FLAG, False)
    """Run the SwiGLU activation of the MLP (--swiglu) on the fastest correct swiglu here, measured
    once per shape (fwd+bwd) among npuspeed's kernel (CPU: C++ csrc/cpu/swiglu.cpp; CUDA/NPU:
    Triton), the device's native op (NPU: torch_npu.npu_swiglu) and Megatron's own path (never
    slower than the flag off). NPUSPEED_FUSED_OP_PATH=cpp|triton|npu|native|megatron forces one."""


class FusedSwiGLUFeature(FusedOpFeature, name="fused_swiglu", Config=Config, patches=_patches, plan=_plan,
                         switch="use_fused_swiglu", fused=_plan.FUSED, built_module=swiglu,
                         npu_kernel=npu_ops.SWIGLU, source="csrc/cpu/swiglu.cpp", triton_module="swiglu",
                         megatron_path="eager silu(gate) * up, or bias_swiglu_impl"):
    """Everything it does is the fused-op rule (fused_op_base.FusedOpFeature) with the values above."""
