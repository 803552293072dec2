"""--use-fused-linear-cross-entropy's one patch: the GPT model's output-layer-and-loss step runs the
chunked loss (postprocess.py) where it applies, with the per-shape choice `chooser` (candidates.py)."""
from __future__ import annotations


def register(registry, ctx, config, feature: str, chooser) -> None:
    from npuspeed.features.fused_linear_ce import postprocess

    registry.register(postprocess.TARGET, wrapper=postprocess.make_postprocess(chooser, ctx.accelerator, ctx.note),
                      feature=feature, megatron=postprocess.MEGATRON_RANGE)
