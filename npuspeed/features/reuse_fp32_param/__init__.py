"""Shared fp32 masters: the feature and its flag (reuse_fp32_param_feature.py), its patches on
Megatron's mixed-precision optimizers (patches.py), its plan effect (plan.py), the exact codec
(codec.py, triton_codec.py) and the masters it keeps (shared_masters.py)."""
from npuspeed.features.base import FeatureError
from npuspeed.features.reuse_fp32_param import codec, patches
from npuspeed.features.reuse_fp32_param.reuse_fp32_param_feature import FLAG, ReuseFp32ParamFeature

__all__ = ["ReuseFp32ParamFeature", "FeatureError", "FLAG", "codec", "patches"]
