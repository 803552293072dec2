"""A plan's inputs read once: the flags parsed, the features asked, their effects merged.

`read(argv)` parses the flags once (flags.py: the RunSpec and Megatron's flags as the features
see them), builds the features' Context (context.py), lists every problem (the layout's, the
features' refusals, what the planner does not model) and, when there is none, merges the
enabled features' plan effects (effects.py). The planner resolves the run from the result
(run.py) and never reads argv again; what a feature removes is planned from the same inputs
with that feature's flags left out (planner.py: context.make and effects.collect again).
"""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.plan import context, effects as effects_mod
from npuspeed.plan.flags import build_parser, megatron_args, parse
from npuspeed.plan.spec import RunSpec, layout_problems, microbatch_problems


@dataclass(frozen=True)
class Inputs:
    argv: tuple
    spec: RunSpec
    #: Megatron's flags as the features see them (flags.megatron_args)
    megatron: object
    ctx: object
    features: list
    problems: tuple
    #: the enabled features' merged plan effects (None when there are problems)
    effects: object = None
    #: the calibration profile (`--profile`, or given), None without
    profile: dict | None = None


def read(argv: list[str], profile=None, spec: RunSpec | None = None, megatron=None) -> Inputs:
    """The inputs of `argv` (`--script` already expanded); `profile`: unless --profile names one;
    `spec` and `megatron` (flags.megatron_args): a parse of `argv` already made (the CLI's)."""
    if spec is None:
        spec, ns, _rest = parse(argv)
        megatron = megatron_args(ns)
        if profile is None and ns.profile:
            from npuspeed.plan.speed import load_profile

            profile = load_profile(ns.profile)
    elif megatron is None:
        megatron = megatron_args(build_parser().parse_known_args(list(argv))[0])
    problems = layout_problems(spec, microbatches=False)
    ctx, features, refused = context.make(argv, megatron)
    problems += refused
    effects = None
    if not problems:  # the micro-batch count's needs depend on the schedule the features run
        effects = effects_mod.collect(spec, ctx, features)
        problems += microbatch_problems(spec, effects.schedule) + effects_mod.not_modeled(spec, effects)
    return Inputs(argv=tuple(argv), spec=spec, megatron=megatron, ctx=ctx, features=features,
                  problems=tuple(problems), effects=effects, profile=profile)
