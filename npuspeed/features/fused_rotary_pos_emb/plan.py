"""--use-fused-rotary-pos-emb in `npuspeed plan`: the RoPE slot runs one fused kernel, where the
model's position embedding is rope."""
from npuspeed.features.fused_op_base import Fused

FUSED = Fused(op="rotary_pos_emb", slot="rope", saves="no per-call cos/sin tensors saved",
              replaces="Megatron's unfused rotary position embedding (--position-embedding-type rope)")


def effect(model, config):
    return FUSED.effect(model.model.position_embedding == "rope")
