"""Fused MoE token permute/unpermute (`--use-fused-moe-token-permute-and-unpermute`): the feature
and its flag (moe_fused_permute_feature.py), its patches (patches.py), its plan effect (plan.py),
the wrappers that choose the op per shape (permute.py; the ops: npuspeed/ops/moe_permute.py)."""
from npuspeed.features.moe_fused_permute.moe_fused_permute_feature import MoeFusedPermuteFeature

__all__ = ["MoeFusedPermuteFeature"]
