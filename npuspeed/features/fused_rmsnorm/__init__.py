"""Fused RMSNorm: the feature and its flag (fused_rmsnorm_feature.py), its patch (patches.py),
its plan effect (plan.py), the fused norm module (rmsnorm.py)."""
from npuspeed.features.fused_rmsnorm.fused_rmsnorm_feature import FLAG, FusedRMSNormFeature

__all__ = ["FusedRMSNormFeature", "FLAG"]
