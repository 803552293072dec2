"""--use-fused-rmsnorm in `npuspeed plan`: the norm slot runs one fused kernel, where the model's
norm is RMSNorm."""
from __future__ import annotations


#: the op (npuspeed.ops module) the flag routes to, and what it replaces (the report and the plan)
OP = "rms_norm"
REPLACES = "the torch.nn.RMSNorm of --normalization RMSNorm"


def effect(model, config):
    from npuspeed.features.fused_op_base import fused_slot

    if model.model.normalization != "RMSNorm":
        return None
    return fused_slot("norm", f"{REPLACES}: one fused kernel ({OP})", "saves the input and an fp32 rstd, not x * rstd")
