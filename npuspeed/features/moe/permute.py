"""--use-fused-moe-token-permute-and-unpermute: Megatron's `moe_utils.permute` / `unpermute`
run npuspeed's fused ops (npuspeed/ops/moe_permute.py).

Upstream's unfused pair transposes the routing map and the probabilities into dense
[experts, tokens] copies, masks and gathers, then scatter-adds back; its `fused=True` branch
needs Transformer Engine. Both functions keep their signature and results (same row order,
same sorted_indices meaning off NPU), so every dispatcher that calls them (all-to-all,
all-gather) gets the fused ops; the token dispatchers bind them by name, which the registry
rebinds. A caller asking for TE's fused kernels (`fused=True`, Megatron's
`--moe-permute-fusion`) keeps upstream's function.
"""
from __future__ import annotations

import functools

from npuspeed.ops.moe_permute import moe_permute, moe_unpermute

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
MEGATRON_RANGE = ">=0.13,<0.17"  # permute returns (tokens, probs, sorted_indices) since 0.13


def permute_wrapper(original):
    @functools.wraps(original)
    def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False):
        if fused:
            return original(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                            drop_and_pad=drop_and_pad)
        permuted, permuted_probs, sorted_indices, _ = moe_permute(
            tokens, routing_map, probs, num_out_tokens=num_out_tokens, drop_and_pad=drop_and_pad)
        return permuted, permuted_probs, sorted_indices

    return permute


def unpermute_wrapper(original):
    @functools.wraps(original)
    def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
                  drop_and_pad=False):
        if fused:
            return original(permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
                            fused=fused, drop_and_pad=drop_and_pad)
        return moe_unpermute(permuted_tokens, sorted_indices, restore_shape[0], probs, routing_map,
                             drop_and_pad=drop_and_pad)

    return unpermute


def register(registry, feature: str) -> None:
    kw = dict(feature=feature, megatron=MEGATRON_RANGE)
    registry.register(f"{MOE_UTILS}.permute", wrapper=permute_wrapper, **kw)
    registry.register(f"{MOE_UTILS}.unpermute", wrapper=unpermute_wrapper, **kw)
