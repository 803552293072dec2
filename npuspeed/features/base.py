"""What a feature is: flags, validation, patches, a check of the built model, a report line.

Every hook gets the run's `Context` (npuspeed/context.py): npuspeed's flags (`ctx.args`),
Megatron's flags as given (`ctx.megatron`), the accelerator, the note sink and the counters.
A feature never imports the runtime or the argument parser.
"""
from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PlanEffect:
    """What a feature changes in a run's memory or time, stated once, for `npuspeed plan`.

    The planner replays Megatron's ops (npuspeed/plan/ops.py); a feature names the op-graph
    slots it swaps (`variants`, e.g. {"core_attention": "flash"}), which calibrated kernel
    times an op kind (`kernels`), how much of a parallel dimension's communication it hides
    (`overlap`, e.g. {"tp": 0.5}) and what the fp32 master keeps between steps. A slot or
    value the planner does not know is an error there, so the two cannot drift apart.
    """

    #: op-graph slot -> variant (npuspeed/plan/ops.py VARIANTS)
    variants: dict = field(default_factory=dict)
    #: slot -> how many layers of each pipeline stage it applies to (None/absent: all)
    variant_layers: dict = field(default_factory=dict)
    #: bytes per parameter the fp32 master keeps between optimizer steps (None: unchanged)
    master_bytes_per_param: float | None = None
    #: op kind -> the calibrated kernel that runs it (npuspeed/plan/speed.py KERNELS)
    kernels: dict = field(default_factory=dict)
    #: parallel dimension ("tp", "dp", "pp", "cp", "ep") -> fraction of its time hidden
    overlap: dict = field(default_factory=dict)
    #: settings of the variants it names (npuspeed/plan/ops.py OPTIONS, e.g. {"cp_ulysses": 2})
    options: dict = field(default_factory=dict)
    #: parallel dimension -> bytes one rank sends per layer and micro-batch, forward and backward
    #: (replaces the planner's own estimate for that dimension)
    comm_per_layer: dict = field(default_factory=dict)
    #: optimizer states (and masters where "masters") off the device between steps
    #: (--swap-optimizer): {"frees": bool, "masters": bool, "window_bytes": int held during the
    #: step, "link_bytes_per_s": float, "overlapped": bool (copies hidden behind the update)}
    swap_optimizer: dict = field(default_factory=dict)
    #: --swap-modules names whose saved activations are kept in host memory between forward
    #: and backward (npuspeed/plan/ops.py SWAP_PARTS); empty where the host is the device
    swap_modules: tuple = ()
    #: one line for the plan: what it removes or costs
    summary: str = ""

from npuspeed.errors import UserError


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
        return self.always_on

    def validate(self, ctx) -> None:
        """Raise FeatureError for combinations that cannot work (known from the flags alone)."""

    def prepare(self, ctx) -> None:
        """Side effects that must precede patching (enabled features only)."""

    def register_patches(self, registry, ctx) -> None:
        """Record this feature's patches in the registry (nothing is installed here)."""

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
        None: nothing in this run (e.g. a flag that does not apply to this model)."""
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
