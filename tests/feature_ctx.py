"""A feature `Context` for tests that call feature hooks directly (as the runtime would)."""
from __future__ import annotations


def ctx_for(argv=(), accelerator="runtime"):
    """The context `runtime.initialize(argv)` would build; `accelerator` defaults to the
    runtime's own, or give any object (None where a hook must not need one)."""
    from npuspeed import arguments, runtime
    from npuspeed.features import all_features

    if accelerator == "runtime":
        accelerator = runtime.initialize([]).accelerator
    return runtime.make_context(all_features(), arguments.argv_with_env(list(argv)), accelerator)

