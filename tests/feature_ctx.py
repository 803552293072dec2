"""A feature `Context` for tests that call feature hooks directly (as the runtime would)."""
from __future__ import annotations

import contextlib


def ctx_for(argv=(), accelerator="runtime"):
    """The context `runtime.initialize(argv)` would build; `accelerator` defaults to the
    runtime's own, or give any object (None where a hook must not need one)."""
    from npuspeed import arguments, runtime
    from npuspeed.features import all_features

    if accelerator == "runtime":
        accelerator = runtime.initialize([]).accelerator
    return runtime.make_context(all_features(), arguments.argv_with_env(list(argv)), accelerator)


@contextlib.contextmanager
def features_enabled(argv: list[str]):
    """Turn on the opt-in features named by `argv` on top of the runtime; undo them after.
    Yields npuspeed's parsed flags; the features' context is `features_enabled.ctx`."""
    from npuspeed import runtime
    from npuspeed.features import all_features, build_check
    from npuspeed.patching import registry

    state = runtime.initialize([])
    every = all_features()
    ctx = runtime.make_context(every, list(argv), state.accelerator)
    active = [f for f in every if not f.always_on and f.enabled(ctx.args)]
    features_enabled.ctx = ctx
    try:
        for feature in active:
            feature.validate(ctx)
            feature.prepare(ctx)
        runtime.activate(active, ctx)
        yield ctx.args
    finally:
        for feature in active:
            registry.remove(feature.name)
        registry.remove(build_check.NAME)
