"""One configuration planned: flags in, per-rank memory, communication and speed out.

`plan(argv)` is what `npuspeed plan` prints and what the validation compares with measured
runs. It is one pass: the inputs read once (inputs.py: flags, the features' Context, the
problems, the merged plan effects), the run resolved once (run.py), then memory, communication
and speed read that ResolvedRun. An impossible layout is a result (its reasons listed), never
an exception; flags the planner cannot read raise PlanInputError with the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from npuspeed.plan import comm, context, effects as effects_mod, fb_overlap, inputs as inputs_mod, memory, script, speed
from npuspeed.plan.context import PlannedDevice, context_for  # noqa: F401  (re-exported)
from npuspeed.plan.flags import PlanInputError  # noqa: F401  (re-exported)
from npuspeed.plan.run import ResolvedRun, resolve
from npuspeed.plan.spec import RunSpec


@dataclass
class Plan:
    spec: RunSpec
    problems: list
    ranks: list = field(default_factory=list)  # RankMemory per pipeline stage
    effects: object = None
    comm: dict = field(default_factory=dict)
    speed: object = None  # speed.StepTime or None without a profile
    removes: dict = field(default_factory=dict)  # feature -> peak bytes it removes (+) or adds (-)
    #: the run resolved once (run.py): what memory, communication and speed were read from
    run: ResolvedRun | None = None
    #: --moe-fb-overlap: the step with and without it at the device's rates (fb_overlap.py)
    fb_overlap: object = None

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def peak(self) -> int:
        return max((r.peak for r in self.ranks), default=0)

    @property
    def fits(self) -> bool | None:
        cap = self.spec.device_memory_bytes
        return None if cap is None or not self.ok else self.peak <= cap


def plan(argv: list[str], profile=None, with_removes: bool = True, spec: RunSpec | None = None,
         megatron=None) -> Plan:
    """The plan of `argv`: inputs read once, the run resolved once, then memory, communication,
    speed and what each feature removes. `spec`/`megatron`: a parse of `argv` already made."""
    argv = script.expand(list(argv))
    inputs = inputs_mod.read(argv, profile, spec, megatron)
    result = Plan(spec=inputs.spec, problems=list(inputs.problems), effects=inputs.effects)
    if result.problems:
        return result
    result.run = run = resolve(inputs.spec, inputs.effects)
    result.ranks = memory.predict(run)
    result.comm = comm.volume(run)
    if inputs.profile is not None:
        result.speed = speed.step_time(run, inputs.profile)
    if run.effects.fb_pairs is not None:
        result.fb_overlap = fb_overlap.predict(run, inputs.ctx.accelerator.name)
    for feature in inputs.features if with_removes else ():
        if feature.name not in inputs.effects.features or feature.name == "context_parallel":
            continue  # context parallelism is a layout, not a memory feature: at CP 1 it is another layout
        argv_without = [a for a in inputs.argv if a not in set(feature.flags)]
        ctx = context.make(argv_without, inputs.megatron, inputs.features, validate=False)[0]
        other = resolve(inputs.spec, effects_mod.collect(inputs.spec, ctx, inputs.features))
        result.removes[feature.name] = max(r.peak for r in memory.predict(other)) - result.peak
    return result


def plan_spec(spec: RunSpec, argv: list[str], profile=None, with_removes: bool = True, megatron=None) -> Plan:
    """The plan of `spec` (parsed from `argv`; `megatron`: flags.megatron_args of that parse)."""
    return plan(argv, profile, with_removes, spec, megatron)


def expand_script(argv: list[str]) -> list[str]:
    """`--script FILE` replaced by the launch script's arguments (script.expand)."""
    return script.expand(argv)
