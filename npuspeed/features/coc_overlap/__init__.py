"""Compute-communication overlap for tensor parallelism: the feature and its flags
(coc_overlap_feature.py), its patches (patches.py), its plan effect (plan.py), the mechanism
(layers.py, functions.py, comm.py, chunking.py, mc2.py)."""
from npuspeed.features.coc_overlap.coc_overlap_feature import CocOverlapFeature
from npuspeed.features.coc_overlap.patches import LAYERS, MEGATRON_RANGE

__all__ = ["CocOverlapFeature", "LAYERS", "MEGATRON_RANGE"]
