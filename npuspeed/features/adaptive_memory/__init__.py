"""Adaptive recompute for a device memory budget (`--adaptive-recompute-device-size MB
[--adaptive-memory-optimization]`, MindSpeed's names).

Before the run starts, npuspeed's planner chooses per layer of each pipeline stage what to keep
and what to recompute so that the predicted per-rank peak fits the budget at the least
predicted step time (npuspeed/plan/adaptive.py); the choice is written as the explicit flags
the features and Megatron already honour (`--recompute-norm[-num-layers]`,
`--recompute-activation-function[-num-layers]`, Megatron's block full recompute) and applied
by the adaptor before anything parses them. This feature owns the flags, refuses what cannot
combine, and reports the chosen policy.
"""
from __future__ import annotations

from npuspeed.features.base import Feature, FeatureError

MAIN, OPT = "--adaptive-recompute-device-size", "--adaptive-memory-optimization"
#: flags the policy sets itself: giving them too would leave two owners of one choice
OWNED = ("--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-activation-function",
         "--recompute-activation-function-num-layers", "--recompute-norm", "--recompute-norm-num-layers")


class AdaptiveMemoryFeature(Feature):
    name = "adaptive_memory"
    flags = (MAIN, OPT)
    #: the policy becomes explicit flags of other features before planning (plan/adaptive.py)
    plan_neutral = True

    def add_arguments(self, group) -> None:
        group.add_argument(MAIN, type=float, default=None, metavar="MB",
                           help="Device memory budget per rank in MiB: choose per layer keep / norm recompute / "
                                "activation recompute / full recompute (and, with "
                                f"{OPT} on a device backend, attention swap) to fit it at the least predicted "
                                "step time.")
        group.add_argument(OPT, action="store_true",
                           help=f"With {MAIN}: also consider swapping attention activations to host memory "
                                "where the backend gains from it (not on CPU, where the host is the device).")
        group.add_argument("--adaptive-policy", type=str, default=None, help="(set by npuspeed: the chosen policy)",
                           dest="adaptive_policy")
        group.add_argument("--adaptive-swap", action="store_true",
                           help="(set by npuspeed with --swap-attention: the policy chose the swap)")

    def enabled(self, args) -> bool:
        return getattr(args, "adaptive_recompute_device_size", None) is not None or bool(
            getattr(args, "adaptive_memory_optimization", False))

    def validate(self, ctx) -> None:
        args = ctx.args
        size = getattr(args, "adaptive_recompute_device_size", None)
        if size is None:
            raise FeatureError(f"{OPT} is given without {MAIN}; add {MAIN} MB (the device budget per rank)")
        if size <= 0:
            raise FeatureError(f"{MAIN} must be a positive number of MiB, got {size:g}")
        if getattr(args, "swap_attention", False) and not getattr(args, "adaptive_swap", False):
            raise FeatureError(f"--swap-attention with {MAIN}: the adaptive policy chooses swap itself (MindSpeed "
                               "refuses the pair too); drop --swap-attention")
        if not getattr(args, "adaptive_policy", None):
            raise FeatureError(f"{MAIN} needs the policy chosen before the run: import npuspeed.megatron_adaptor "
                               "(it plans it) rather than enabling features by hand")

    def idle_reason(self, ctx) -> str | None:
        """It patches nothing itself: the chosen policy is explicit flags of other features (each
        refused on its own where its patches do not apply here) and Megatron's own recompute."""
        return "the policy acts through the flags it sets (--recompute-norm, ...), checked as those features"

    def path(self, ctx) -> str:
        args = ctx.args
        if not self.enabled(args):
            return "off"
        return f"budget {args.adaptive_recompute_device_size:g} MiB per rank; policy: {args.adaptive_policy}"


__all__ = ["AdaptiveMemoryFeature", "FeatureError", "OWNED"]
