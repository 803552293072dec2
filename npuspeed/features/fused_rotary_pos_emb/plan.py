"""--use-fused-rotary-pos-emb in `npuspeed plan`: the RoPE slot runs one fused kernel, where the
model's position embedding is rope."""
from __future__ import annotations


#: the op (npuspeed.ops module) the flag routes to, and what it replaces (the report and the plan)
OP = "rotary_pos_emb"
REPLACES = "Megatron's unfused rotary position embedding (--position-embedding-type rope)"


def effect(model, config):
    from npuspeed.features.fused_op_base import fused_slot

    if model.model.position_embedding != "rope":
        return None
    return fused_slot("rope", f"{REPLACES}: one fused kernel ({OP})", "no per-call cos/sin tensors saved")
