"""Fused SwiGLU: the feature and its flag (fused_swiglu_feature.py), its patches (patches.py), its
plan effect (plan.py), the wrappers that route the MLP's activation (swiglu.py)."""
from npuspeed.features.fused_swiglu.fused_swiglu_feature import FLAG, FusedSwiGLUFeature

__all__ = ["FusedSwiGLUFeature", "FLAG"]
