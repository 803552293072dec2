"""Mixture-of-experts acceleration: grouped GEMM experts (`--moe-grouped-gemm`), fused token
permute/unpermute (`--use-fused-moe-token-permute-and-unpermute`), the all-to-all dispatch
in chunks overlapped with the experts and the shared experts (`--moe-alltoall-overlap-comm`),
and experts spread over the tensor-parallel ranks too (`--moe-tp-extend-ep`).

Each flag is one feature (features.py); the patches live beside it: grouped_mlp.py and
grouped_gemm.py, permute.py (ops in npuspeed/ops/moe_permute.py), overlap.py with
pipeline.py and a2a.py, tp_extend_ep.py.
"""
from __future__ import annotations

from npuspeed.features.moe.features import (
    FEATURES, AllToAllOverlapFeature, FusedPermuteFeature, GroupedGemmFeature, TpExtendEpFeature,
)

__all__ = ["FEATURES", "AllToAllOverlapFeature", "FusedPermuteFeature", "GroupedGemmFeature", "TpExtendEpFeature"]
