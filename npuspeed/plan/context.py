"""The features' view of a planned run: the device it is for and the runtime's Context.

`make(argv, megatron)` builds, from one argv and the planner's own parse of Megatron's flags
(flags.megatron_args), what runtime.make_context builds for a training run, and lists what
the enabled features refuse (FeatureError: a problem of the plan, never an exception).
"""
from __future__ import annotations

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


def device(argv: list[str]):
    """The accelerator `argv` plans for: this machine's, or a PlannedDevice (--npuspeed-device)."""
    from npuspeed.accelerator import get_accelerator

    for i, a in enumerate(argv):
        if a.startswith("--npuspeed-device"):
            name = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "auto")
            if name not in ("auto", get_accelerator().name):
                return PlannedDevice(name)
    return get_accelerator()


def make(argv: list[str], megatron, features=None, validate: bool = True):
    """(Context, features, what the enabled features refuse) for `argv`; `megatron`: the
    planner's parse of Megatron's flags (flags.megatron_args); `validate`: ask the features."""
    import functools

    from npuspeed import arguments
    from npuspeed.context import Context
    from npuspeed.features import all_features
    from npuspeed.features.base import FeatureError

    acc, argv = device(argv), list(argv)
    features = all_features() if features is None else features
    extend = functools.partial(arguments.add_arguments, features=features)
    ctx = Context(arguments.parse_args(features, argv), megatron, acc, tuple(argv), extend_parser=extend)
    problems = []
    for feature in features:
        if validate and feature.enabled(ctx.args) and not feature.always_on:
            try:
                feature.validate(ctx)
            except FeatureError as exc:
                problems.append(str(exc))
    return ctx, features, problems


def context_for(argv: list[str], megatron=None):
    """The features' Context for `argv` and the features (calibrate.py's, the tests'); Megatron's
    flags parsed here unless given."""
    if megatron is None:
        from npuspeed.plan.flags import build_parser, megatron_args

        megatron = megatron_args(build_parser().parse_known_args(list(argv))[0])
    ctx, features, _ = make(argv, megatron, validate=False)
    return ctx, features
