"""--moe-fb-overlap's patches: the PP-1 schedule's forward_step/backward_step held and paired
(schedule.py), at PP > 1 Megatron's interleaved schedule with each step paired (interleaved.py),
the token dispatcher's all-to-all asynchronous with the turn passed (exchange.py), the experts'
local linears with their weight gradient split off (wgrad.py; the grouped experts split theirs in
grouped_gemm.py), and, where Megatron has its own flag (0.14+), its TransformerConfig checks
taken over."""
from __future__ import annotations

SCHEDULES = "megatron.core.pipeline_parallel.schedules"
DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
MOE_LAYER = "megatron.core.transformer.moe.moe_layer"
LAYERS = "megatron.core.tensor_parallel.layers"
CONFIG = "megatron.core.transformer.transformer_config.TransformerConfig.__post_init__"


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.features.moe_fb_overlap import (bubble, combine, exchange, interleaved, masking,
                                                 schedule, takeover, wgrad)

    bubble.register(registry, ctx, feature)  # PP > 1: the bubble measured (first: innermost wrappers)
    registry.register(f"{SCHEDULES}.forward_backward_no_pipelining", wrapper=schedule.no_pipelining_wrapper(ctx.note),
                      feature=feature)
    registry.register(f"{SCHEDULES}.forward_step", wrapper=schedule.forward_step_wrapper, feature=feature)
    registry.register(f"{SCHEDULES}.backward_step", wrapper=schedule.backward_step_wrapper, feature=feature)
    registry.register(f"{DISPATCHER}.all_to_all", exchange.all_to_all, feature=feature)
    dispatcher = f"{DISPATCHER}.MoEAlltoAllTokenDispatcher"
    registry.register(f"{dispatcher}.token_dispatch", wrapper=exchange.token_dispatch_wrapper, feature=feature,
                      megatron=">=0.13")
    registry.register(f"{dispatcher}.token_combine", wrapper=combine.token_combine_wrapper,
                      feature=feature, megatron=">=0.13")
    for target, wrapper in (("shared_experts_compute", masking.shared_experts_compute_wrapper),
                            ("postprocess", masking.postprocess_wrapper)):
        registry.register(f"{MOE_LAYER}.MoELayer.{target}", wrapper=wrapper, feature=feature, megatron=masking.RANGE)
    registry.register(f"{LAYERS}.linear_with_grad_accumulation_and_async_allreduce", wrapper=wgrad.linear_wrapper,
                      feature=feature, megatron=wgrad.RANGE)
    registry.register(CONFIG, wrapper=takeover.config_wrapper(ctx.note), feature=feature, megatron=takeover.RANGE)
    if config.schedules_method == "dualpipev":
        return  # DualPipeV's schedule pairs its steps itself (npuspeed/features/dualpipev/)
    # PP > 1 (0.14+): Megatron's interleaved schedule, its extra warm-up micro-batch, each step paired
    flag = config.flag_given
    registry.register(f"{SCHEDULES}.forward_backward_pipelining_with_interleaving",
                      wrapper=interleaved.interleaving_wrapper(flag, ctx.note), feature=feature,
                      megatron=interleaved.RANGE)
    registry.register(f"{SCHEDULES}.combined_1f1b_schedule_for_interleaved_pipelining", interleaved.paired_step,
                      feature=feature, megatron=interleaved.RANGE)
    registry.register(f"{SCHEDULES}.forward_backward_pipelining_without_interleaving",
                      wrapper=interleaved.refuse_plain_1f1b(flag), feature=feature, megatron=interleaved.RANGE)
