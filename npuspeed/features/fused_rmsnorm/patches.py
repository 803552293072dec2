"""--use-fused-rmsnorm's one patch: WrappedTorchNorm.__new__ turns the torch.nn.RMSNorm it builds
into rmsnorm.FusedRMSNorm; the fused-op chooser is first pointed at the run's accelerator."""
from __future__ import annotations


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.features.chooser_setup import configure
    from npuspeed.features.fused_rmsnorm import rmsnorm

    configure(ctx)
    registry.register(rmsnorm.TARGET, wrapper=rmsnorm.fused_norm, feature=feature)
