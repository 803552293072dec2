"""--gradient-accumulation-fusion's patches: the layers' backward routes each weight gradient
through the per-shape choice, and, without apex, Megatron's layers module gets the stand-in for
`fused_weight_gradient_mlp_cuda` and is told it is there."""
from __future__ import annotations

from npuspeed.patching.versions import importable

LAYERS = "megatron.core.tensor_parallel.layers"


def apex_kernel_installed() -> bool:
    """Whether apex's own CUDA extension imports (then Megatron uses it and we stay out)."""
    return importable("fused_weight_gradient_mlp_cuda")


def register(registry, ctx, config, feature: str, chooser) -> None:
    from npuspeed.features.grad_accum_fusion import placeholder

    apex = apex_kernel_installed()
    # with apex too: the weight's placeholder gradient becomes a view of main_grad, and a
    # shape whose unfused path measured faster runs Megatron's unfused backward
    registry.register(placeholder.TARGET, wrapper=placeholder.layer_backward(chooser, route=not apex),
                      feature=feature, megatron=">=0.12")
    if apex:
        return  # Megatron already has the real kernel; nothing to provide
    from npuspeed.features.grad_accum_fusion.wgrad import WgradAccumulator

    registry.register(f"{LAYERS}.fused_weight_gradient_mlp_cuda", WgradAccumulator(chooser),
                      feature=feature, megatron=">=0.12", if_missing=True)
    # the layers refuse gradient_accumulation_fusion unless this is True (set at import
    # from whether apex's module imported)
    registry.register(f"{LAYERS}._grad_accum_fusion_available", True, feature=feature, megatron=">=0.12")
