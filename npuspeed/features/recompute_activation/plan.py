"""--recompute-activation-function in `npuspeed plan`: the MLP activation of the selected layers is
not held between forward and backward."""
from __future__ import annotations


def effect(model, config):
    from npuspeed.features.base import PlanEffect

    from npuspeed.features.first_layers import per_chunk

    n = config.recompute_activation_function_num_layers
    which = per_chunk(n)
    return PlanEffect(
        variants={"mlp_activation": "recompute"}, variant_layers={"mlp_activation": n},
        summary=f"the MLP activation output (tokens x ffn/TP) of {which} "
                "is not held between forward and backward; one layer's copy is recomputed in backward")
