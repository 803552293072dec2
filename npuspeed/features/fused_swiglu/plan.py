"""--use-fused-swiglu in `npuspeed plan`: the GLU slot runs one fused kernel, where the model's MLP
is SwiGLU."""
from __future__ import annotations


def effect(model, config, what: str):
    """`what`: the feature's words for what it fuses (the plan's summary)."""
    from npuspeed.features.fused_op_base import fused_slot

    if not model.model.swiglu:
        return None
    return fused_slot("glu", what, "saves fc1's output only, not silu(gate) and its product")
