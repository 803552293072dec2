"""--schedules-method dualpipev's patches: the V placement (placement.py) and Megatron's
interleaved schedule replaced by DualPipeV's (schedule.py) for training and evaluation calls."""
from __future__ import annotations

SCHEDULES = "megatron.core.pipeline_parallel.schedules"


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.features.dualpipev import placement, schedule
    from npuspeed.features.moe_fb_overlap import bubble

    measure = bubble.measuring(ctx)
    if measure and not config.pairs_overlap:  # the overlap's feature registers them otherwise
        bubble.register_chunk_timers(registry, feature)
    registry.register("megatron.core.transformer.transformer_layer.get_transformer_layer_offset",
                      wrapper=placement.offset_wrapper, feature=feature, megatron=placement.RANGE)
    registry.register("megatron.core.parallel_state.is_pipeline_last_stage", wrapper=placement.last_stage_wrapper,
                      feature=feature, megatron=placement.RANGE)
    registry.register("megatron.core.pipeline_parallel.utils.is_pp_last_stage", wrapper=placement.pp_last_wrapper,
                      feature=feature, megatron=placement.RANGE)
    registry.register("megatron.core.utils.get_batch_on_this_tp_rank", wrapper=placement.batch_on_tp_rank_wrapper,
                      feature=feature, megatron=">=0.18,<0.20")  # Megatron-LM's batch split: rank 0 is both ends
    registry.register(f"{SCHEDULES}.forward_backward_pipelining_with_interleaving",
                      wrapper=schedule.wrapper(ctx.note, config.pairs_overlap, measure), feature=feature,
                      megatron=placement.RANGE)
