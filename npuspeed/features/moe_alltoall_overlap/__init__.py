"""The MoE all-to-all in chunks overlapped with the experts (`--moe-alltoall-overlap-comm
[--moe-alltoall-chunks N]`): the feature and its flags (moe_alltoall_overlap_feature.py), its
patch (patches.py), its plan effect (plan.py), the chunked layer (overlap.py), its schedule
(pipeline.py) and the asynchronous all-to-all (a2a.py)."""
from npuspeed.features.moe_alltoall_overlap.moe_alltoall_overlap_feature import MoeAllToAllOverlapFeature

__all__ = ["MoeAllToAllOverlapFeature"]
