"""Gradient-accumulation fusion without apex: the feature and its flag
(grad_accum_fusion_feature.py), its patches (patches.py), its plan effect (plan.py: none), the
stand-in kernel (wgrad.py, kernels.py), the per-shape choice (candidates.py) and the layers'
backward (placeholder.py)."""
from npuspeed.features.base import FeatureError
from npuspeed.features.grad_accum_fusion.grad_accum_fusion_feature import (FLAG, LAYERS, GradAccumFusionFeature,
                                                                           apex_kernel_installed)

__all__ = ["GradAccumFusionFeature", "FeatureError", "FLAG", "LAYERS", "apex_kernel_installed"]
