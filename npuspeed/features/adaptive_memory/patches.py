"""--adaptive-recompute-device-size patches nothing itself: the chosen policy is written as
explicit flags of other features (OWNED; npuspeed/plan/adaptive.py writes them before anything
parses the command line), each patched and refused on its own where its patches do not apply
here, and Megatron's own recompute."""
from __future__ import annotations

#: flags the policy sets itself: giving them too would leave two owners of one choice
OWNED = ("--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-activation-function",
         "--recompute-activation-function-num-layers", "--recompute-norm", "--recompute-norm-num-layers")
#: what the feature says instead of a patch (npuspeed/patching/coverage.py asks for it)
IDLE_REASON = "the policy acts through the flags it sets (--recompute-norm, ...), checked as those features"


def register(registry, ctx, config, feature: str) -> None:
    """Registers nothing (see the module docstring): the policy's flags bring their own patches."""
