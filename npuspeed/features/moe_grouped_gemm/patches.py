"""--moe-grouped-gemm's patches: Megatron's GroupedMLP runs on every backend (0.13-0.16), and the
local spec builds npuspeed's grouped experts instead of SequentialMLP (0.17-0.19)."""
from __future__ import annotations


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.features.chooser_setup import configure
    from npuspeed.features.moe_grouped_gemm import grouped_experts, grouped_mlp

    configure(ctx)
    kw = dict(feature=feature, megatron=grouped_mlp.MEGATRON_RANGE)  # GroupedMLP, 0.13-0.16
    gg_util, experts = grouped_mlp.GG_UTIL, grouped_mlp.EXPERTS
    registry.register(f"{gg_util}.assert_grouped_gemm_is_available", grouped_mlp.assert_grouped_gemm_available, **kw)
    registry.register(f"{gg_util}.grouped_gemm_is_available", grouped_mlp.grouped_gemm_available, **kw)
    registry.register(f"{experts}.GroupedMLP.forward", grouped_mlp.forward, **kw)
    registry.register(f"{experts}.GroupedMLP.__init__", wrapper=grouped_mlp.count_built, **kw)
    # npuspeed's own module, 0.17-0.19
    registry.register(f"{grouped_experts.BACKENDS}.LocalSpecProvider.grouped_mlp_modules",
                      wrapper=grouped_experts.spec_wrapper, feature=feature, megatron=grouped_experts.MEGATRON_RANGE)
