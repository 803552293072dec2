"""--use-fused-swiglu in `npuspeed plan`: the GLU slot runs one fused kernel, where the model's MLP
is SwiGLU."""
from npuspeed.features.fused_op_base import Fused

FUSED = Fused(op="swiglu", replaces="the SwiGLU activation of the MLP (--swiglu)", slot="glu",
              saves="saves fc1's output only, not silu(gate) and its product")


def effect(model, config):
    return FUSED.effect(bool(model.model.swiglu))
