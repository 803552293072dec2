"""--recompute-norm in `npuspeed plan`: the norm outputs of the selected layers are not held."""
from __future__ import annotations


def effect(model, config):
    from npuspeed.features.base import PlanEffect

    from npuspeed.features.first_layers import per_chunk

    n = config.recompute_norm_num_layers
    which = per_chunk(n)
    return PlanEffect(
        variants={"norm_output": "recompute"}, variant_layers={"norm_output": n},
        summary=f"the input and pre-MLP norm outputs (2 x tokens x hidden) and the norms' statistics of "
                f"{which} are not held between forward and backward; one norm is recomputed at a time")
