"""The features, in apply order. The device layer comes first: the others build on it."""
from __future__ import annotations

from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.device import DeviceFeature
from npuspeed.features.fused_attention import FusedAttentionFeature
from npuspeed.features.fused_ops import FusedRMSNormFeature, FusedRoPEFeature, FusedSwiGLUFeature


def all_features() -> list[Feature]:
    return [DeviceFeature(), FusedAttentionFeature(), FusedRMSNormFeature(), FusedSwiGLUFeature(),
            FusedRoPEFeature()]


__all__ = ["Feature", "FeatureError", "all_features"]
