"""--recompute-norm's one patch: TransformerBlock.__init__ picks the layers whose norms recompute."""
from __future__ import annotations


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.features.recompute_norm import norms

    registry.register(norms.TARGET, wrapper=norms.selector(config.recompute_norm_num_layers, ctx.note),
                      feature=feature)
