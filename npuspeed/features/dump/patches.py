"""--npuspeed-dump's patches: a wrapper on each of Megatron's three schedules (the one place every
Megatron script's training step passes through: the model chunks, the step's start and end, the
losses). Wrappers compose with other features' (--moe-fb-overlap, --schedules-method dualpipev)."""
from __future__ import annotations

SCHEDULES = "megatron.core.pipeline_parallel.schedules"
TARGETS = tuple(f"{SCHEDULES}.{name}" for name in (
    "forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving"))


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.features.dump import hooks
    from npuspeed.features.dump.selection import parse_modules, parse_steps

    dumper = hooks.Dumper(config.npuspeed_dump, parse_steps(config.dump_steps), parse_modules(config.dump_modules),
                          config.dump_level or "stats", ctx.note)
    for target in TARGETS:
        registry.register(target, wrapper=dumper.wrap_schedule, feature=feature)
