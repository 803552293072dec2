"""The features, in apply order. The device layer comes first: the others build on it."""
from __future__ import annotations

from npuspeed.features.adaptive_memory import AdaptiveMemoryFeature
from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.coc_overlap import CocOverlapFeature
from npuspeed.features.context_parallel import ContextParallelFeature
from npuspeed.features.device import DeviceFeature
from npuspeed.features.dualpipev import DualPipeVFeature
from npuspeed.features.dump import DumpFeature
from npuspeed.features.fp8 import Fp8Feature
from npuspeed.features.fused_attention import FusedAttentionFeature
from npuspeed.features.fused_linear_ce import FusedLinearCEFeature
from npuspeed.features.fused_rmsnorm import FusedRMSNormFeature
from npuspeed.features.fused_rotary_pos_emb import FusedRotaryPosEmbFeature
from npuspeed.features.fused_swiglu import FusedSwiGLUFeature
from npuspeed.features.grad_accum_fusion import GradAccumFusionFeature
from npuspeed.features.megatron_lm import MegatronLMFeature
from npuspeed.features.moe_alltoall_overlap import MoeAllToAllOverlapFeature
from npuspeed.features.moe_fb_overlap import MoeFbOverlapFeature
from npuspeed.features.moe_fused_permute import MoeFusedPermuteFeature
from npuspeed.features.moe_grouped_gemm import MoeGroupedGemmFeature
from npuspeed.features.moe_tp_extend_ep import MoeTpExtendEpFeature
from npuspeed.features.recompute_activation import RecomputeActivationFeature
from npuspeed.features.recompute_norm import RecomputeNormFeature
from npuspeed.features.reuse_fp32_param import ReuseFp32ParamFeature
from npuspeed.features.swap_attention import SwapAttentionFeature
from npuspeed.features.swap_optimizer import SwapOptimizerFeature


def all_features() -> list[Feature]:
    return [DeviceFeature(), FusedAttentionFeature(), ContextParallelFeature(), FusedRMSNormFeature(), FusedSwiGLUFeature(),
            FusedRotaryPosEmbFeature(), FusedLinearCEFeature(), ReuseFp32ParamFeature(), RecomputeActivationFeature(),
            RecomputeNormFeature(), SwapAttentionFeature(), SwapOptimizerFeature(), GradAccumFusionFeature(),
            CocOverlapFeature(), Fp8Feature(), AdaptiveMemoryFeature(), MoeTpExtendEpFeature(), MoeGroupedGemmFeature(), MoeFusedPermuteFeature(),
            MoeAllToAllOverlapFeature(), MoeFbOverlapFeature(), DualPipeVFeature(), MegatronLMFeature(), DumpFeature()]


__all__ = ["Feature", "FeatureError", "all_features"]
