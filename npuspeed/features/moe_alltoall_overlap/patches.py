"""--moe-alltoall-overlap-comm's patches: MoELayer.forward runs dispatch, experts and combine in
chunks (one wrapper: the steps it calls kept their contracts 0.16-0.19), and each of Megatron's
schedule functions runs its step as the step trial says (candidates.py: chunked or Megatron's layer)."""
from __future__ import annotations


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.features.moe_alltoall_overlap import candidates, overlap

    for spec in overlap.RANGES:
        registry.register(f"{overlap.MOE_LAYER}.MoELayer.forward", wrapper=overlap.forward_wrapper(config.chunks, ctx.note),
                          feature=feature, megatron=spec)
    for name in candidates.STEP_FUNCTIONS:
        registry.register(f"{candidates.SCHEDULES}.{name}", wrapper=candidates.step_wrapper(ctx.note), feature=feature)
