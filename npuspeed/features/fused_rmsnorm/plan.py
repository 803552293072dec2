"""--use-fused-rmsnorm in `npuspeed plan`: the norm slot runs one fused kernel, where the model's
norm is RMSNorm."""
from npuspeed.features.fused_op_base import Fused

FUSED = Fused(op="rms_norm", replaces="the torch.nn.RMSNorm of --normalization RMSNorm", slot="norm",
              saves="saves the input and an fp32 rstd, not x * rstd")


def effect(model, config):
    return FUSED.effect(model.model.normalization == "RMSNorm")
