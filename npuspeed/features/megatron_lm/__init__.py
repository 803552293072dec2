"""Megatron-LM integration: the feature (megatron_lm_feature.py), its patches (patches.py), its
plan effect (plan.py: none), the mechanism (parser.py, validate.py, load_stubs.py,
device_fixes.py, build_helpers.py, targets.py; source_patch.py for `npuspeed patch-source`)."""
from npuspeed.features.base import FeatureError
from npuspeed.features.megatron_lm import build_helpers, device_fixes, load_stubs, parser, targets, validate
from npuspeed.features.megatron_lm.megatron_lm_feature import (
    LOAD_TIME_IMPORTS, MEGATRON_LM_RANGE, MegatronLMFeature, megatron_lm_present,
)
from npuspeed.features.megatron_lm.patches import MLT

__all__ = ["MegatronLMFeature", "FeatureError", "MEGATRON_LM_RANGE", "LOAD_TIME_IMPORTS", "MLT",
           "megatron_lm_present", "build_helpers", "device_fixes", "load_stubs", "parser", "targets", "validate"]
