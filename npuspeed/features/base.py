"""What a feature is: flags, validation, patches, a check of the built model, a report line.

Every hook gets the run's `Context` (npuspeed/context.py): npuspeed's flags (`ctx.args`),
Megatron's flags as given (`ctx.megatron`), the accelerator, the note sink and the counters.
A feature never imports the runtime or the argument parser.
"""
from __future__ import annotations

import argparse
import inspect

from npuspeed.errors import UserError
from npuspeed.patching.wrappers import followed_by
from npuspeed.plan_vocabulary import PlanEffect, PlanEffectError  # noqa: F401  (re-exported: a plan.effect returns one)

#: `Feature.plan` of a class that has not said its plan module (or None)
NOT_SAID = "not said"


class FeatureError(UserError, ValueError):
    """A flag combination the feature cannot honour; the message names the flag and the fix."""


class Feature:
    #: short name used in the registry and the report (= its folder under npuspeed/features/)
    name: str = ""
    #: flags this feature owns (for --npuspeed-help); derived from `Config` where it has one
    flags: tuple[str, ...] = ()
    #: the typed flags (npuspeed/features/config.py): its fields generate the argparse group
    Config: type | None = None
    #: True for features that apply whatever the flags say (the device layer)
    always_on: bool = False
    #: the Config field that turns the feature on, for a feature that one boolean flag enables
    switch: str | None = None
    #: options that only make sense with another flag, {Config field: the field it needs}; such an
    #: option given alone turns the feature on, so that `check_requires` (first in `validate`)
    #: refuses it in one message naming both flags and the fix
    requires: dict[str, str] = {}
    #: its folder's patches module, imported by name in its <name>_feature.py:
    #: `register(registry, ctx, config, feature)` records its patches; None: it patches nothing
    patches = None
    #: its folder's plan module, imported alike: `effect(model, config)` gives its PlanEffect (or
    #: None in a run it does not change); None: it changes nothing the planner models. Every
    #: feature says which (a test checks; the planner refuses an enabled feature that does not)
    plan = NOT_SAID

    def __init_subclass__(cls, **declared):
        """A feature declares its wiring in its class statement, as keyword arguments that set the
        attributes above (`class XFeature(Feature, name="x", Config=Config, patches=_patches,
        plan=_plan, switch="x")`; a subclass such as FusedOpFeature adds its own). A keyword that
        names no such attribute is a TypeError, so a misspelt one never passes unseen."""
        super().__init_subclass__()
        for key, value in declared.items():
            if not hasattr(cls, key) or inspect.isroutine(getattr(cls, key)):
                raise TypeError(f"{cls.__name__}({', '.join(b.__name__ for b in cls.__bases__)}, {key}=...): "
                                f"{key} is not a feature attribute to declare")
            setattr(cls, key, value)
        if cls.__dict__.get("Config") is not None and "flags" not in cls.__dict__:
            cls.flags = cls.Config.flags()

    def add_arguments(self, group: argparse._ArgumentGroup) -> None:
        """Add this feature's flags to the npuspeed argument group (from `Config` by default)."""
        if self.Config is not None:
            self.Config.add_arguments(group)

    def config(self, args: argparse.Namespace):
        """This feature's typed flags in `args` (an instance of `Config`)."""
        return self.Config.from_args(args)

    def enabled(self, args: argparse.Namespace) -> bool:
        if self.switch is not None:
            config = self.config(args)
            return any(_given(config, f) for f in (self.switch, *self.requires))
        return self.always_on

    def check_requires(self, config) -> None:
        """Raise FeatureError for an option of `requires` given without the flag it needs."""
        for option, needed in self.requires.items():
            if _given(config, option) and not _given(config, needed):
                value = getattr(config, option)
                given = flag_of(config, option) + ("" if isinstance(value, bool) else f" {value}")
                raise FeatureError(f"{given} is given without {flag_of(config, needed)}; add {flag_of(config, needed)} "
                                   f"(or drop {flag_of(config, option)})")

    def validate(self, ctx) -> None:
        """Raise FeatureError for combinations that cannot work (known from the flags alone)."""

    def prepare(self, ctx) -> None:
        """Side effects that must precede patching (enabled features only)."""

    def register_patches(self, registry, ctx) -> None:
        """Record this feature's patches in the registry (nothing is installed here):
        `self.patches.register(registry, ctx, config, name)`."""
        if self.patches is not None:
            self.patches.register(registry, ctx, self.config(ctx.args), self.name)

    def idle_reason(self, ctx) -> str | None:
        """Why this feature, enabled, registers no patch in this run (it acts some other way), or
        None. A feature that registers none and gives no reason is refused at start-up
        (npuspeed/patching/coverage.py): a flag never silently does nothing."""
        return None

    def check_built(self, block, ctx) -> str | None:
        """After Megatron built a TransformerBlock with layers: why this feature does nothing
        in it (the error to raise, naming the flag and what it needs), or None when it acts."""
        return None

    def plan_effect(self, model, ctx) -> PlanEffect | None:
        """How this feature, enabled with ctx's flags, changes the planner's model of a run of
        `model` (npuspeed/plan/spec.py RunSpec: `model`, `layout`, `batch`, the planned `device`):
        `self.plan.effect(model, config)`. None: nothing in this run (e.g. a flag that does not
        apply to this model), or `plan = None`."""
        if self.plan is NOT_SAID:
            raise PlanEffectError(f"feature {self.name} is enabled but does not say its plan effect: give its class "
                                  "plan = <its plan module> (effect(model, config)), or plan = None where it "
                                  "changes nothing the planner models")
        return None if self.plan is None else self.plan.effect(model, self.config(ctx.args))

    def path(self, ctx) -> str:
        """The report's line: "off" where the flags leave this feature off, else `running(ctx)`."""
        return self.running(ctx) if self.enabled(ctx.args) else "off"

    def running(self, ctx) -> str:
        """Which implementation runs, for the report (e.g. 'npu_fusion_attention'); asked of an
        enabled feature only."""
        return "on"


def _given(config, field: str) -> bool:
    """Whether the flag of `field` was given: its value is not the field's default (a switch: true)."""
    value, default = getattr(config, field), type(config).__dataclass_fields__[field].default
    return bool(value) != default if isinstance(default, bool) else value != default


def flag_of(config, field: str) -> str:
    return type(config).__dataclass_fields__[field].metadata["argparse"]["flag"]


def after_init(apply, *args):
    """A registry wrapper for a module's `__init__` (TransformerBlock's): once the module is
    built, run `apply(module, *args)` (the features that pick layers of a built block)."""
    return followed_by(lambda module, _none: apply(module, *args))
