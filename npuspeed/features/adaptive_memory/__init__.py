"""Adaptive recompute for a device memory budget: the feature and its flags
(adaptive_memory_feature.py), the flags its policy sets instead of patches (patches.py), its
plan effect, none of its own (plan.py); the policy is chosen by npuspeed/plan/adaptive.py."""
from npuspeed.features.adaptive_memory.adaptive_memory_feature import AdaptiveMemoryFeature
from npuspeed.features.adaptive_memory.patches import OWNED
from npuspeed.features.base import FeatureError

__all__ = ["AdaptiveMemoryFeature", "FeatureError", "OWNED"]
