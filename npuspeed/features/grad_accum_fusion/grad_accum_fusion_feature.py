"""Gradient-accumulation fusion without apex (`--gradient-accumulation-fusion`, Megatron's flag).

Megatron-Core computes each ColumnParallelLinear / RowParallelLinear weight gradient
straight into the parameter's `main_grad` when `gradient_accumulation_fusion` is set, but
only with apex's `fused_weight_gradient_mlp_cuda`; without it the layer refuses to build.
This feature supplies that module (wgrad.py) and tells Megatron it is there, so Megatron's
own backward runs unchanged. Which GEMM computes the update is chosen per device, dtype and
shape (candidates.py): in place, or the unfused GEMM + add where that measures faster. The patches:
patches.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.grad_accum_fusion import patches as _patches
from npuspeed.features.grad_accum_fusion.patches import LAYERS, apex_kernel_installed  # noqa: F401

FLAG = "--gradient-accumulation-fusion"


@dataclass(frozen=True)
class Config(FeatureConfig):
    gradient_accumulation_fusion: bool = flag(FLAG, False)
    """Megatron's gradient-accumulation fusion without apex: each linear layer's weight gradient
    is added into its main_grad by one GEMM (CPU: in-place addmm, measured per shape against
    GEMM + add; CUDA: torch's mixed-dtype addmm; NPU: torch_npu._npu_matmul_add_fp32)."""


class GradAccumFusionFeature(Feature, name="grad_accum_fusion", Config=Config, patches=_patches,
                             # no plan effect: the planner models neither the weight-gradient temporary nor
                             # its add (a transient of one layer's weight size); the time is at most the
                             # unfused one by the chooser's rule
                             plan=None, switch="gradient_accumulation_fusion"):
    def __init__(self):
        self.chooser = None

    def validate(self, ctx) -> None:
        if "--defer-embedding-wgrad-compute" in ctx.argv and not apex_kernel_installed():
            raise FeatureError(
                f"{FLAG}: Megatron's --defer-embedding-wgrad-compute imports apex's "
                "fused_weight_gradient_mlp_cuda itself, which npuspeed does not replace; "
                "drop --defer-embedding-wgrad-compute (or install apex)")
        if getattr(ctx.megatron, "transformer_impl", None) == "transformer_engine":
            ctx.note(f"{FLAG}: Transformer Engine's linear layers fuse the weight-gradient "
                     "accumulation themselves; npuspeed's path serves Megatron's local linears only")

    def prepare(self, ctx) -> None:
        from npuspeed.features.grad_accum_fusion.candidates import WgradPaths

        self.chooser = WgradPaths(ctx.accelerator, ctx.note)

    def register_patches(self, registry, ctx) -> None:
        """The base's call, with the per-shape chooser the report reads (candidates.py)."""
        if self.chooser is None:
            self.prepare(ctx)
        self.patches.register(registry, ctx, self.config(ctx.args), self.name, self.chooser)

    def check_built(self, block, ctx) -> str | None:
        config = getattr(block, "config", None)
        if config is None or getattr(config, "gradient_accumulation_fusion", False):
            return None
        return (f"{FLAG}: this model's TransformerConfig has gradient_accumulation_fusion=False, so "
                "the flag would do nothing; set gradient_accumulation_fusion=True in the config "
                "(Megatron-LM and the example pass the flag through)")

    def running(self, ctx) -> str:
        if apex_kernel_installed():
            return "apex's fused_weight_gradient_mlp_cuda (installed; Megatron uses it directly)"
        from npuspeed import telemetry
        from npuspeed.features.grad_accum_fusion.candidates import PREFIX

        calls = telemetry.snapshot(PREFIX)
        choices = self.chooser.summary() if self.chooser is not None else "not prepared"
        return (f"npuspeed's stand-in for fused_weight_gradient_mlp_cuda in {LAYERS} "
                f"(CPU: in-place addmm or GEMM + add, measured per shape; CUDA: addmm out_dtype=fp32; "
                f"NPU: torch_npu._npu_matmul_add_fp32); shapes: {choices}; counters: {calls or 'none yet'}")
