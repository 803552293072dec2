"""Fused attention: the feature and its flags (fused_attention_feature.py), its patches
(patches.py), its plan effect (plan.py), the mechanism (masks.py: Megatron's masking as a
kernel-neutral plan; forward.py, npu.py, sdpa.py, kernel_rows.py; candidates.py), and from the shared
room `features/attention/` the dropout seeds (dropout.py) and the CP/packed-documents path (cp_attention.py)."""
from npuspeed.features.fused_attention.forward import kernel_calls
from npuspeed.features.fused_attention.fused_attention_feature import FusedAttentionFeature
from npuspeed.features.fused_attention.patches import MEGATRON_RANGE, TARGET

__all__ = ["FusedAttentionFeature", "kernel_calls", "TARGET", "MEGATRON_RANGE"]
