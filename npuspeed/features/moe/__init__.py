"""Mixture-of-experts acceleration: grouped GEMM experts (`--moe-grouped-gemm`), fused token
permute/unpermute (`--use-fused-moe-token-permute-and-unpermute`), the all-to-all dispatch
in chunks overlapped with the experts and the shared experts (`--moe-alltoall-overlap-comm`),
and experts spread over the tensor-parallel ranks too (`--moe-tp-extend-ep`).

Each flag is one feature (*_feature.py: flags, checks, report line); the patches live beside
it: grouped_mlp.py with grouped_gemm.py, permute.py (ops in npuspeed/ops/moe_permute.py),
overlap.py with pipeline.py and a2a.py, tp_extend_ep.py; layout.py reads the expert layout.
"""
from __future__ import annotations

from npuspeed.features.moe.alltoall_overlap_feature import AllToAllOverlapFeature
from npuspeed.features.moe.fused_permute_feature import FusedPermuteFeature
from npuspeed.features.moe.grouped_gemm_feature import GroupedGemmFeature
from npuspeed.features.moe.tp_extend_ep_feature import TpExtendEpFeature

FEATURES = (GroupedGemmFeature, FusedPermuteFeature, AllToAllOverlapFeature, TpExtendEpFeature)

__all__ = ["FEATURES", "AllToAllOverlapFeature", "FusedPermuteFeature", "GroupedGemmFeature", "TpExtendEpFeature"]
