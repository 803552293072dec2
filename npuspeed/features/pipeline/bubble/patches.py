"""Where the bubble measure wraps Megatron (its send/receive, forward_step and backward_step, its
pipelined schedules), and when: `measuring` says, the features that own a pipelined schedule
register it (`register`, `register_chunk_timers`), the device feature the baseline
(`register_for_megatron`)."""
from __future__ import annotations

from npuspeed.features.pipeline.bubble import measure

P2P = "megatron.core.pipeline_parallel.p2p_communication"
SCHEDULES = "megatron.core.pipeline_parallel.schedules"


def measuring(ctx) -> bool:
    """At PP > 1: on CPU always (draining the host is free), on a device only with
    NPUSPEED_MEASURE_BUBBLE=1 (draining it at every send/receive and chunk would cost time)."""
    import os

    if (ctx.megatron.pipeline_model_parallel_size or 1) < 2:
        return False
    from npuspeed.accelerator.devices import for_device

    # a device with streams queues work the drains would wait for; the host runs it at once
    return not for_device(ctx.accelerator.name).has_streams() or os.environ.get(measure.MEASURE_ENV) == "1"


def register_chunk_timers(registry, feature: str) -> None:
    """Registered first, so innermost: a pair's forward and backward are the timed calls."""
    registry.register(f"{SCHEDULES}.forward_step", wrapper=measure.forward_step_wrapper, feature=feature)
    registry.register(f"{SCHEDULES}.backward_step", wrapper=measure.backward_step_wrapper, feature=feature)


def register_for_megatron(registry, ctx, feature: str) -> None:
    """With NPUSPEED_MEASURE_BUBBLE=1 and neither --moe-fb-overlap nor DualPipeV on (they register
    the measure themselves): Megatron's own pipelined schedules measured, the baseline of
    benchmarks/bench_pipeline_bubble.py (registered by the device feature, always on)."""
    import os

    from npuspeed.features.pipeline.which import pairs_overlap, v_schedule

    if os.environ.get(measure.MEASURE_ENV) != "1" or pairs_overlap(ctx.args) or v_schedule(ctx.args):
        return
    register(registry, ctx, feature)


def register(registry, ctx, feature: str) -> None:
    """Megatron's pipelined schedules measured, where `measuring` says."""
    if not measuring(ctx):
        return
    register_chunk_timers(registry, feature)
    registry.register(f"{P2P}._communicate", wrapper=measure.communicate_wrapper, feature=feature, megatron="<0.14")
    registry.register(f"{P2P}.P2PCommunicator._communicate", wrapper=measure.communicate_wrapper, feature=feature,
                      megatron=">=0.14")
    for name in ("forward_backward_pipelining_with_interleaving", "forward_backward_pipelining_without_interleaving"):
        registry.register(f"{SCHEDULES}.{name}", wrapper=measure.schedule_wrapper, feature=feature)
