"""Attention activation swap: the feature and its flags (swap_attention_feature.py), its patch
(patches.py), its plan effect (plan.py), the mechanism (swap.py, modules.py)."""
from npuspeed.features.base import FeatureError
from npuspeed.features.swap_attention.patches import MIN_BYTES
from npuspeed.features.swap_attention.swap_attention_feature import SwapAttentionFeature, parse_modules

__all__ = ["SwapAttentionFeature", "FeatureError", "MIN_BYTES", "parse_modules"]
