"""--moe-tp-extend-ep in `npuspeed plan`: experts over EP x TP ranks, each whole (expert TP 1):
fewer, unsplit experts per rank."""
from __future__ import annotations


def effect(model, config):
    from npuspeed.features.base import PlanEffect

    lay = model.layout
    if not model.model.num_experts or lay.tp < 2:
        return None
    return PlanEffect(options={"moe_ep": lay.ep * lay.tp, "moe_etp": 1},
                      summary=f"experts over EP x TP = {lay.ep * lay.tp} ranks, each whole on one rank "
                              "(no expert-TP all-gather of tokens)")
