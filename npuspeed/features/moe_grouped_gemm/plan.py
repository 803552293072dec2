"""--moe-grouped-gemm in `npuspeed plan`: GroupedMLP's two weights for all local experts, one
grouped mm each, SwiGLU x probability fused."""
from __future__ import annotations


def effect(model, config):
    from npuspeed.features.base import PlanEffect

    if not model.model.num_experts:
        return None
    return PlanEffect(options={"moe_grouped": True},
                      summary="local experts as one grouped matmul per weight (GroupedMLP); SwiGLU x router "
                              "probability in one op (saves its input only)")
