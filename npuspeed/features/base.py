"""What a feature is: flags, validation, patches, a check of the built model, a report line.

Every hook gets the run's `Context` (npuspeed/context.py): npuspeed's flags (`ctx.args`),
Megatron's flags as given (`ctx.megatron`), the accelerator, the note sink and the counters.
A feature never imports the runtime or the argument parser.
"""
from __future__ import annotations

import argparse
import functools
import importlib

from npuspeed.errors import UserError
from npuspeed.plan_vocabulary import PlanEffect  # noqa: F401  (re-exported: a feature's plan_effect returns one)


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
    #: True for features that change neither memory nor time the planner models (and so do
    #: not override `plan_effect`); a test checks every feature says one or the other
    plan_neutral: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
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
            return bool(getattr(self.config(args), self.switch))
        return self.always_on

    def validate(self, ctx) -> None:
        """Raise FeatureError for combinations that cannot work (known from the flags alone)."""

    def prepare(self, ctx) -> None:
        """Side effects that must precede patching (enabled features only)."""

    def register_patches(self, registry, ctx) -> None:
        """Record this feature's patches in the registry (nothing is installed here): in the one
        shape, its folder's `patches.register(registry, ctx, config, name)`. A feature whose
        patches need more (the accelerator, a chooser) overrides this."""
        patches = self._own_module("patches")
        if patches is not None:
            patches.register(registry, ctx, self.config(ctx.args), self.name)

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
        `model` (npuspeed/plan/spec.py ModelSpec, with `layout` and `batch` attributes).
        None: nothing in this run (e.g. a flag that does not apply to this model). In the one
        shape, its folder's `plan.effect(model, config)`."""
        plan = None if self.plan_neutral else self._own_module("plan")
        return None if plan is None else plan.effect(model, self.config(ctx.args))

    def states_plan_effect(self) -> bool:
        """Whether it has a plan effect of its own: its folder's plan.py, or an override."""
        return type(self).plan_effect is not Feature.plan_effect or self._own_module("plan") is not None

    def _own_module(self, leaf: str):
        """npuspeed.features.<name>.<leaf> when this class lives in its own folder (the one
        shape) and the module exists, else None."""
        package = type(self).__module__.rpartition(".")[0]
        if package != f"npuspeed.features.{self.name}" or self.Config is None:
            return None
        try:
            return importlib.import_module(f"{package}.{leaf}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{package}.{leaf}":
                raise
            return None

    def path(self, ctx) -> str:
        """Which implementation runs, for the report (e.g. 'npu_fusion_attention')."""
        return "on" if self.enabled(ctx.args) else "off"


def after_init(apply, *args):
    """A registry wrapper for a module's `__init__` (TransformerBlock's): once the module is
    built, run `apply(module, *args)` (the features that pick layers of a built block)."""

    def wrap(init):
        @functools.wraps(init)
        def __init__(self, *a, **kwargs):
            init(self, *a, **kwargs)
            apply(self, *args)

        return __init__

    return wrap
