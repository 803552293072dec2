"""--use-fused-swiglu in `npuspeed plan`: the GLU slot runs one fused kernel, where the model's MLP
is SwiGLU."""
from __future__ import annotations


#: the op (npuspeed.ops module) the flag routes to, and what it replaces (the report and the plan)
OP = "swiglu"
REPLACES = "the SwiGLU activation of the MLP (--swiglu)"


def effect(model, config):
    from npuspeed.features.fused_op_base import fused_slot

    if not model.model.swiglu:
        return None
    return fused_slot("glu", f"{REPLACES}: one fused kernel ({OP})",
                      "saves fc1's output only, not silu(gate) and its product")
