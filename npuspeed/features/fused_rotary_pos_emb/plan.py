"""--use-fused-rotary-pos-emb in `npuspeed plan`: the RoPE slot runs one fused kernel, where the
model's position embedding is rope."""
from __future__ import annotations


def effect(model, config, what: str):
    """`what`: the feature's words for what it fuses (the plan's summary)."""
    from npuspeed.features.fused_op_base import fused_slot

    if model.model.position_embedding != "rope":
        return None
    return fused_slot("rope", what, "no per-call cos/sin tensors saved")
