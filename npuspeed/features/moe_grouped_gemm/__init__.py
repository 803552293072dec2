"""Grouped GEMM experts (`--moe-grouped-gemm`): the feature and its flag
(moe_grouped_gemm_feature.py), its patches (patches.py), its plan effect (plan.py), the grouped
matmul (grouped_gemm.py), Megatron's GroupedMLP made to run everywhere (grouped_mlp.py, 0.13-0.16)
and npuspeed's grouped experts (grouped_experts.py, 0.17-0.19)."""
from npuspeed.features.moe_grouped_gemm.moe_grouped_gemm_feature import MoeGroupedGemmFeature

__all__ = ["MoeGroupedGemmFeature"]
