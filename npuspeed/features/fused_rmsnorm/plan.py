"""--use-fused-rmsnorm in `npuspeed plan`: the norm slot runs one fused kernel, where the model's
norm is RMSNorm."""
from __future__ import annotations


def effect(model, config, what: str):
    """`what`: the feature's words for what it fuses (the plan's summary)."""
    from npuspeed.features.fused_op_base import fused_slot

    if model.model.normalization != "RMSNorm":
        return None
    return fused_slot("norm", what, "saves the input and an fp32 rstd, not x * rstd")
