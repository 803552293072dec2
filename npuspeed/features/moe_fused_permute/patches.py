"""--use-fused-moe-token-permute-and-unpermute's patches: Megatron's moe_utils permute/unpermute
call the fused ops (one wrapper pair per release range: 0.17 added the padded signature)."""
from __future__ import annotations


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.features.chooser_setup import configure
    from npuspeed.features.moe_fused_permute import permute

    configure(ctx)
    for spec, perm, unperm in ((permute.TRIPLE_RANGE, permute.permute_wrapper, permute.unpermute_wrapper),
                               (permute.PADDED_RANGE, permute.permute_padded_wrapper, permute.unpermute_padded_wrapper)):
        kw = dict(feature=feature, megatron=spec)
        registry.register(f"{permute.MOE_UTILS}.permute", wrapper=perm, **kw)
        registry.register(f"{permute.MOE_UTILS}.unpermute", wrapper=unperm, **kw)
