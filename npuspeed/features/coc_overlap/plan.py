"""--use-coc in `npuspeed plan`: with tensor parallelism, (N-1)/N of each linear's all-gather /
reduce-scatter time hidden behind the matmuls of its N row chunks; nothing without TP."""
from __future__ import annotations


def effect(model, config):
    from npuspeed.features.base import PlanEffect

    if model.layout.tp < 2:
        return None
    n = config.coc_parallel_num or 1
    return PlanEffect(overlap={"tp": (n - 1) / n},
                      summary=f"tensor-parallel all-gather / reduce-scatter of each linear in {n} row "
                              f"chunks behind the matmuls: up to {(n - 1) / n:.0%} of their time hidden")
