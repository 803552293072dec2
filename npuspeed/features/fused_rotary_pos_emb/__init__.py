"""Fused RoPE: the feature and its flag (fused_rotary_pos_emb_feature.py), its patches
(patches.py), its plan effect (plan.py), the bshd wrapper (rope.py) and the q+k pairing
(rope_qk.py)."""
from npuspeed.features.fused_rotary_pos_emb.fused_rotary_pos_emb_feature import FLAG, FusedRotaryPosEmbFeature

__all__ = ["FusedRotaryPosEmbFeature", "FLAG"]
