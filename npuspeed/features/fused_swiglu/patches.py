"""--use-fused-swiglu's patches: Megatron's bias_swiglu_impl runs the fused op, and MLP.__init__
routes a gated-SiLU MLP built without bias_activation_fusion to it (swiglu.py); the fused-op
chooser is first pointed at the run's accelerator."""
from __future__ import annotations


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.features.chooser_setup import configure
    from npuspeed.features.fused_swiglu import swiglu

    configure(ctx)
    registry.register(swiglu.BIAS_SWIGLU, wrapper=swiglu.fused_bias_swiglu, feature=feature)
    registry.register(swiglu.MLP_INIT, wrapper=swiglu.route_mlp, feature=feature)
