"""One configuration planned: flags in, per-rank memory, communication and speed out.

`plan(argv)` is what `npuspeed plan` prints and what the validation compares with measured
runs. An impossible layout is a result (its reasons listed), never an exception; flags the
planner cannot read raise PlanInputError with the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from npuspeed.plan import comm, effects as effects_mod, memory, speed
from npuspeed.plan.flags import PlanInputError, build_parser, megatron_args, parse
from npuspeed.plan.run import ResolvedRun, resolve
from npuspeed.plan.spec import RunSpec, layout_problems


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


#: what a backend that is not this machine's can do, by backend (absent: False)
PLANNED_CAPABILITIES = {
    "npu": {"fused_attention": True, "bf16": True, "mc2": True, "pinned_memory": True},
    "cuda": {"fused_attention": True, "bf16": True, "pinned_memory": True},
    "cpu": {"fused_attention": True, "bf16": True, "host_is_device": True},
}


class PlannedDevice:
    """The device a plan is for when it is not this machine's (`--npuspeed-device npu|cuda`):
    what features ask of an accelerator when they state their plan effect."""

    def __init__(self, name: str):
        self.name = name
        self._can = PLANNED_CAPABILITIES.get(name, {})

    def has_fused_attention(self) -> bool:
        return self._can.get("fused_attention", False)

    def is_bf16_supported(self) -> bool:
        return self._can.get("bf16", False)

    def has_mc2(self) -> bool:
        return self._can.get("mc2", False)

    def host_is_device(self) -> bool:
        return self._can.get("host_is_device", False)

    def has_pinned_memory(self) -> bool:
        return self._can.get("pinned_memory", False)

    def host_link_bytes_per_s(self) -> float:
        from npuspeed.accelerator.host_link import host_link_bytes_per_s

        return host_link_bytes_per_s(self.name)


def _device(argv: list[str]):
    from npuspeed.accelerator import get_accelerator

    for i, a in enumerate(argv):
        if a.startswith("--npuspeed-device"):
            name = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "auto")
            if name not in ("auto", get_accelerator().name):
                return PlannedDevice(name)
    return get_accelerator()


def context_for(argv: list[str], megatron=None):
    """The features' Context for `argv` (as runtime.make_context builds it), with Megatron's
    flags from the planner's own parse (`megatron`: flags.megatron_args of it) when given."""
    import functools

    from npuspeed import arguments
    from npuspeed.context import Context
    from npuspeed.features import all_features

    features, argv = all_features(), list(argv)
    if megatron is None:
        megatron = megatron_args(build_parser().parse_known_args(argv)[0])
    args = arguments.parse_args(features, argv)
    extend = functools.partial(arguments.add_arguments, features=features)
    return Context(args, megatron, _device(argv), tuple(argv), extend_parser=extend), features


def _feature_problems(ctx, features) -> list[str]:
    from npuspeed.features.base import FeatureError

    out = []
    for feature in features:
        if feature.enabled(ctx.args) and not feature.always_on:
            try:
                feature.validate(ctx)
            except FeatureError as exc:
                out.append(str(exc))
    return out


def plan_spec(spec: RunSpec, argv: list[str], profile=None, with_removes: bool = True, megatron=None) -> Plan:
    """The plan of `spec` (parsed from `argv`; `megatron`: flags.megatron_args of that parse)."""
    problems = layout_problems(spec)
    ctx, features = context_for(argv, megatron)
    problems += _feature_problems(ctx, features)
    result = Plan(spec=spec, problems=problems)
    if problems:
        return result
    result.effects = effects_mod.collect(spec, ctx, features)
    result.problems += _not_modeled(spec, result.effects)
    if result.problems:
        return result
    result.run = run = resolve(spec, result.effects)
    result.ranks = memory.predict(run)
    result.comm = comm.volume(run)
    if profile is not None:
        result.speed = speed.step_time(run, profile)
    if with_removes:
        for name in result.effects.features:
            if name == "context_parallel":
                continue  # a layout, not a memory feature: the plan at CP 1 is another layout
            without = [a for a in argv if a not in _flags_of(features, name)]
            other = effects_mod.collect(spec, context_for(without, ctx.megatron)[0], features)
            result.removes[name] = max(r.peak for r in memory.predict(resolve(spec, other))) - result.peak
    return result


def _not_modeled(spec: RunSpec, effects) -> list[str]:
    """What this planner cannot predict yet, said instead of a wrong number."""
    out = []
    if spec.layout.cp > 1 and effects.variants.get("core_attention") != "cp":
        out.append(f"--context-parallel-size {spec.layout.cp} needs a context-parallel attention: Megatron-Core's "
                   "local DotProductAttention has none (npuspeed's context parallelism feature provides it)")
    return out


def _flags_of(features, name):
    for f in features:
        if f.name == name:
            return set(f.flags)
    return set()


def expand_script(argv: list[str]) -> list[str]:
    """`--script FILE` replaced by the launch script's arguments (flags given here win, later)."""
    if "--script" not in argv:
        return list(argv)
    from npuspeed.plan.script import script_argv

    i = argv.index("--script")
    if i + 1 >= len(argv):
        raise PlanInputError("--script needs a path to a Megatron-LM launch script")
    return script_argv(argv[i + 1]) + argv[:i] + argv[i + 2:]


def plan(argv: list[str], profile=None, with_removes: bool = True) -> Plan:
    argv = expand_script(list(argv))
    spec, ns, _rest = parse(argv)
    if profile is None and ns.profile:
        profile = speed.load_profile(ns.profile)
    return plan_spec(spec, argv, profile, with_removes, megatron_args(ns))
