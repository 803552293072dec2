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

from dataclasses import dataclass

from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.adaptive_memory import patches as _patches

MAIN, OPT = "--adaptive-recompute-device-size", "--adaptive-memory-optimization"


@dataclass(frozen=True)
class Config(FeatureConfig):
    adaptive_recompute_device_size: float | None = flag(MAIN, None, type=float, metavar="MB")
    """Device memory budget per rank in MiB: choose per layer keep / norm recompute / activation
    recompute / full recompute (and, with --adaptive-memory-optimization on a device backend,
    attention swap) to fit it at the least predicted step time."""
    adaptive_memory_optimization: bool = flag(OPT, False)
    """With --adaptive-recompute-device-size: also consider swapping attention activations to host
    memory where the backend gains from it (not on CPU, where the host is the device)."""
    adaptive_policy: str | None = flag("--adaptive-policy", None, type=str)
    """(set by npuspeed: the chosen policy)"""
    adaptive_swap: bool = flag("--adaptive-swap", False)
    """(set by npuspeed with --swap-attention: the policy chose the swap)"""
    # swap_attention's flag (it owns it: no --help here), refused with ours unless the policy chose it
    swap_attention: bool = False


class AdaptiveMemoryFeature(Feature, name="adaptive_memory", Config=Config, patches=_patches,
                            # no plan effect of its own: the policy becomes explicit flags of other features
                            # before planning (plan/adaptive.py), whose effects are counted; counting it here
                            # too would count them twice
                            plan=None,
                            switch="adaptive_recompute_device_size",
                            requires={"adaptive_memory_optimization": "adaptive_recompute_device_size"},
                            # the user's flags; --adaptive-policy and --adaptive-swap are written by npuspeed
                            # (plan/adaptive.py)
                            flags=(MAIN, OPT)):
    def validate(self, ctx) -> None:
        config = self.config(ctx.args)
        self.check_requires(config)
        size = config.adaptive_recompute_device_size
        if size <= 0:
            raise FeatureError(f"{MAIN} must be a positive number of MiB, got {size:g}")
        if config.swap_attention and not config.adaptive_swap:
            raise FeatureError(f"--swap-attention with {MAIN}: the adaptive policy chooses swap itself (MindSpeed "
                               "refuses the pair too); drop --swap-attention")
        if not config.adaptive_policy:
            raise FeatureError(f"{MAIN} needs the policy chosen before the run: import npuspeed.megatron_adaptor "
                               "(it plans it) rather than enabling features by hand")

    def idle_reason(self, ctx) -> str | None:
        from npuspeed.features.adaptive_memory.patches import IDLE_REASON

        return IDLE_REASON

    def running(self, ctx) -> str:
        config = self.config(ctx.args)
        return f"budget {config.adaptive_recompute_device_size:g} MiB per rank; policy: {config.adaptive_policy}"
