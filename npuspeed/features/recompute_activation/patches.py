"""--recompute-activation-function's two patches: the MLP's forward path (mlp.py) and the choice
of layers when a TransformerBlock is built (layers.py)."""
from __future__ import annotations


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.features.recompute_activation import layers, mlp

    registry.register(mlp.TARGET, wrapper=mlp.recompute_activation, feature=feature)
    registry.register(layers.TARGET, wrapper=layers.selector(config.recompute_activation_function_num_layers,
                                                             ctx.note), feature=feature)
