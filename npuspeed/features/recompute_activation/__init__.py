"""Activation-function recompute: the feature and its flags (recompute_activation_feature.py),
its patches (patches.py), its plan effect (plan.py), the mechanism (mlp.py,
layers.py; the checkpoint it shares with --recompute-norm is features/activation_checkpoint.py)."""
from npuspeed.features.base import FeatureError
from npuspeed.features.recompute_activation.recompute_activation_feature import RecomputeActivationFeature

__all__ = ["RecomputeActivationFeature", "FeatureError"]
