"""Fused RMSNorm (`--use-fused-rmsnorm`): each RMSNorm that `--normalization RMSNorm` builds
becomes rmsnorm.FusedRMSNorm, which runs the fastest correct rms_norm measured once per shape
(npuspeed.ops.fused_choice). What the three fused ops share: features/fused_op_base.py."""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed import telemetry
from npuspeed.accelerator import npu_ops
from npuspeed.features.base import FeatureError
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.fused_rmsnorm import patches as _patches, plan as _plan
from npuspeed.features.fused_op_base import FusedOpFeature
from npuspeed.features.fused_rmsnorm import rmsnorm

FLAG = "--use-fused-rmsnorm"


@dataclass(frozen=True)
class Config(FeatureConfig):
    use_fused_rmsnorm: bool = flag(FLAG, False)
    """Run the torch.nn.RMSNorm of --normalization RMSNorm on the fastest correct rms_norm here,
    measured once per shape (fwd+bwd) among npuspeed's kernel (CPU: C++ csrc/cpu/rms_norm.cpp;
    CUDA/NPU: Triton), the device's native op (NPU: torch_npu.npu_rms_norm) and Megatron's own
    path (never slower than the flag off). NPUSPEED_FUSED_OP_PATH=cpp|triton|npu|native|megatron
    forces one."""


class FusedRMSNormFeature(FusedOpFeature, name="fused_rmsnorm", Config=Config, patches=_patches, plan=_plan,
                          switch="use_fused_rmsnorm", fused=_plan.FUSED, built_module=rmsnorm,
                          npu_kernel=npu_ops.RMS_NORM, source="csrc/cpu/rms_norm.cpp", triton_module="rms_norm",
                          megatron_path="torch.nn.RMSNorm: F.rms_norm, torch's native op"):
    def validate(self, ctx) -> None:
        norm = ctx.megatron.normalization
        if norm is not None and norm != "RMSNorm":
            raise FeatureError(f"{FLAG} fuses RMSNorm, but --normalization is {norm}: "
                               f"use --normalization RMSNorm or drop {FLAG}")

    def running(self, ctx) -> str:
        return f"{super().running(ctx)}; {telemetry.get(rmsnorm.SWAPPED)} norms fused"
