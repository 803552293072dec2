"""The features, in apply order. The device layer comes first: the others build on it."""
from __future__ import annotations

from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.device import DeviceFeature
from npuspeed.features.fused_attention import FusedAttentionFeature
from npuspeed.features.fused_ops import FusedRMSNormFeature, FusedRoPEFeature, FusedSwiGLUFeature
from npuspeed.features.megatron_lm import MegatronLMFeature


def all_features() -> list[Feature]:
    return [DeviceFeature(), FusedAttentionFeature(), FusedRMSNormFeature(), FusedSwiGLUFeature(),
            FusedRoPEFeature(), MegatronLMFeature()]


__all__ = ["Feature", "FeatureError", "all_features"]
