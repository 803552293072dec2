"""--reuse-fp32-param in `npuspeed plan`: the fp32 masters are a 16-bit residual between steps."""
from __future__ import annotations


def effect(model, config):
    from npuspeed.features.base import PlanEffect

    if model.batch.dtype != "bf16":
        return None  # fp32 runs have no masters to share
    return PlanEffect(master_bytes_per_param=2.0,
                      summary="fp32 masters kept as a 16-bit residual of the bf16 parameter between "
                              "steps (2 bytes a parameter, /DP with the distributed optimizer); the "
                              "step itself holds full masters, as ordinary mixed precision does")
