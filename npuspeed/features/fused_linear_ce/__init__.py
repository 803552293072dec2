"""Fused linear cross-entropy: the feature and its flags (fused_linear_ce_feature.py), its patch
(patches.py), its plan effect (plan.py), the chunked loss (function.py), the patch point and when
Megatron's path runs instead (postprocess.py), the per-shape choice (candidates.py)."""
from npuspeed.features.base import FeatureError
from npuspeed.features.fused_linear_ce.fused_linear_ce_feature import (CHUNK, FALLBACK, MAIN,
                                                                       FusedLinearCEFeature)

__all__ = ["FusedLinearCEFeature", "FeatureError", "MAIN", "CHUNK", "FALLBACK"]
