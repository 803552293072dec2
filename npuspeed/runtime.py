"""Start-up, once per process: flags, accelerator, validation, patches.

`megatron_adaptor` calls `initialize()` at import; `npuspeed report` calls it with the
flags it is given. A second call returns the first call's state.
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
    notes: list = field(default_factory=list)


_STATE: RuntimeState | None = None


def _setup_logging() -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
        log.propagate = False


def note(message: str) -> None:
    """Record a fallback or a notice for the report (and log it once)."""
    if _STATE is not None and message not in _STATE.notes:
        _STATE.notes.append(message)
        log.warning(message)


def state() -> RuntimeState | None:
    return _STATE


def initialize(argv: list[str] | None = None) -> RuntimeState:
    global _STATE
    if _STATE is not None:
        return _STATE
    _setup_logging()
    from npuspeed import arguments
    from npuspeed.accelerator import get_accelerator
    from npuspeed.features import all_features
    from npuspeed.patching import registry
    from npuspeed.patching.versions import check_supported

    args = arguments.parse_args(argv)
    if args.npuspeed_help:
        print(arguments.features_help())
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
    features = [(f, f.enabled(args)) for f in all_features()]
    active = [f for f, on in features if on]
    for feature in active:
        feature.validate(args, accelerator)
    state = RuntimeState(args, accelerator, features, late)
    _STATE = state
    for feature in active:
        feature.prepare(args, accelerator)
        warning = getattr(feature, "apex_warning", None)
        if warning:
            state.notes.append(warning)
    for feature in active:
        feature.register_patches(registry, args, accelerator)
    registry.apply()
    log.info(
        "npuspeed: device=%s backend=%s features=%s patches=%d",
        accelerator.name, accelerator.dist_backend,
        ",".join(f.name for f in active), len([p for p in registry.report() if p["status"] == "applied"]),
    )
    return state


def reset() -> None:
    """Revert all patches and forget the state (tests)."""
    global _STATE
    from npuspeed.patching import registry

    registry.clear()
    _STATE = None
