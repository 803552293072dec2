"""Norm recompute: the feature and its flags (recompute_norm_feature.py), its patch (patches.py),
its plan effect (plan.py), the mechanism (norms.py)."""
from npuspeed.features.base import FeatureError
from npuspeed.features.recompute_norm.recompute_norm_feature import RecomputeNormFeature

__all__ = ["RecomputeNormFeature", "FeatureError"]
