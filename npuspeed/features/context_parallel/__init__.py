"""Context parallelism without Transformer Engine, and packed documents: the feature and its flags
(context_parallel_feature.py), its patches (patches.py), its plan effect (plan.py), start-up checks
(validate.py), the mechanism (attention.py, ring.py, ulysses.py, blocks.py, kernels_*.py,
documents.py, layout.py, groups.py, comm.py)."""
from npuspeed.features.context_parallel.context_parallel_feature import ContextParallelFeature
from npuspeed.features.context_parallel.patches import MEGATRON_RANGE

__all__ = ["ContextParallelFeature", "MEGATRON_RANGE"]
