"""Start-up, once per process: flags, accelerator, validation, patches.

`megatron_adaptor` calls `initialize()` at import; `npuspeed report` calls it with the
flags it is given. A second call returns the first call's state. It builds the one
`Context` (npuspeed/context.py) that every feature hook receives: the argv given here is
the one every feature reads, and no feature reaches back into this module.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

log = logging.getLogger("npuspeed")


@dataclass
class RuntimeState:
    args: object
    accelerator: object
    features: list  # (feature, enabled)
    late_import: bool
    context: object = None  # the Context every hook got
    notes: list = field(default_factory=list)  # the context's notes (one list)


_STATE: RuntimeState | None = None


def _setup_logging() -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
        log.propagate = False


def state() -> RuntimeState | None:
    return _STATE


def initialize(argv: list[str] | None = None) -> RuntimeState:
    global _STATE
    if _STATE is not None:
        return _STATE
    _setup_logging()
    from npuspeed import arguments
    from npuspeed.accelerator import get_accelerator
    from npuspeed.features import all_features, upstream_flags
    from npuspeed.patching import registry
    from npuspeed.patching.versions import check_supported

    every = all_features()
    argv = arguments.argv_with_env(argv)
    args = arguments.parse_args(every, argv)
    if args.npuspeed_help:
        print(arguments.features_help(every))
        raise SystemExit(0)
    if args.npuspeed_device != "auto":
        os.environ["NPUSPEED_DEVICE"] = args.npuspeed_device
    late = "megatron.core" in sys.modules
    if late:
        log.warning(
            "npuspeed: megatron.core was imported before npuspeed.megatron_adaptor; by-value "
            "copies of patched functions are rebound where found, but put "
            "`import npuspeed.megatron_adaptor` right after `import torch` to be sure."
        )
    check_supported()
    accelerator = get_accelerator()
    ctx = make_context(every, argv, accelerator)
    features = [(f, f.enabled(args)) for f in every]
    active = [f for f, on in features if on]
    upstream_flags.refuse(active, ctx)  # a pair with Megatron's own feature first: one line naming both
    for feature in active:
        feature.validate(ctx)
    state = RuntimeState(args, accelerator, features, late, ctx, ctx.notes)
    _STATE = state
    for feature in active:
        feature.prepare(ctx)
    activate(active, ctx)
    log.info(
        "npuspeed: device=%s backend=%s features=%s patches=%d",
        accelerator.name, accelerator.dist_backend,
        ",".join(f.name for f in active), len([p for p in registry.report() if p["status"] == "applied"]),
    )
    return state


def make_context(features, argv: list[str], accelerator):
    """The Context for `argv` (already with NPUSPEED_ARGS) and this feature list."""
    import functools

    from npuspeed import arguments, megatron_flags
    from npuspeed.context import Context

    return Context(arguments.parse_args(features, argv), megatron_flags.parse(argv), accelerator,
                   tuple(argv), extend_parser=functools.partial(arguments.add_arguments, features=features))


def activate(features, ctx) -> None:
    """Register and apply the patches of `features` (enabled, validated, prepared), and the
    model-build check of those that can be idle in a built model; a feature left with no
    applied patch on this release is refused (patching/coverage.py)."""
    from npuspeed.features import build_check
    from npuspeed.patching import coverage, registry

    for feature in features:
        feature.register_patches(registry, ctx)
    build_check.register(registry, features, ctx)
    registry.apply()
    coverage.refuse_idle(features, registry, ctx)


def reset() -> None:
    """Revert all patches and forget the state (tests)."""
    global _STATE
    from npuspeed.patching import registry

    registry.clear()
    _STATE = None
