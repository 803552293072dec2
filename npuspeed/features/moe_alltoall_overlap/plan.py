"""--moe-alltoall-overlap-comm in `npuspeed plan`: dispatch/combine in N chunks, each chunk's
all-to-all behind another chunk's experts."""
from __future__ import annotations


def effect(model, config):
    from npuspeed.features.base import PlanEffect

    if not model.model.num_experts:
        return None
    n = config.chunks
    return PlanEffect(options={"moe_chunks": n}, overlap={"ep": (n - 1) / n},
                      summary=f"expert all-to-alls in {n} chunks overlapped with the experts: up to "
                              f"{(n - 1) / n:.0%} of their time hidden")
