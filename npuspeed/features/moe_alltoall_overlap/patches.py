"""--moe-alltoall-overlap-comm's patch: MoELayer.forward runs dispatch, experts and combine in
chunks (one wrapper: the steps it calls kept their contracts 0.16-0.19)."""
from __future__ import annotations


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.features.moe_alltoall_overlap import overlap

    for spec in overlap.RANGES:
        registry.register(f"{overlap.MOE_LAYER}.MoELayer.forward", wrapper=overlap.forward_wrapper(config.chunks, ctx.note),
                          feature=feature, megatron=spec)
