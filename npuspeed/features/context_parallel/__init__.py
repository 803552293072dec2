"""Context parallelism without Transformer Engine, and packed documents: the feature and its flags
(context_parallel_feature.py), its patches (patches.py), its plan effect (plan.py), start-up checks
(validate.py). The mechanism (ring and Ulysses attention, block kernels, documents, the layout
and groups) is in the shared room `features/attention/`: fused attention's forward runs it too,
for packed documents at CP 1."""
from npuspeed.features.context_parallel.context_parallel_feature import ContextParallelFeature
from npuspeed.features.context_parallel.patches import MEGATRON_RANGE

__all__ = ["ContextParallelFeature", "MEGATRON_RANGE"]
