"""Optimizer state off the device between steps: the feature and its flags
(swap_optimizer_feature.py), its patches (patches.py), its plan effect (plan.py), the mechanism
(swapper.py)."""
from npuspeed.features.base import FeatureError
from npuspeed.features.swap_optimizer.swap_optimizer_feature import (CHUNK, ENV, FLAG, FRACTION, OFFLOAD,
                                                                      WINDOW_CHUNKS, SwapOptimizerFeature,
                                                                      host_is_device, moves, te_installed)

__all__ = ["SwapOptimizerFeature", "FeatureError", "CHUNK", "ENV", "FLAG", "FRACTION", "OFFLOAD", "WINDOW_CHUNKS",
           "host_is_device", "moves", "te_installed"]
