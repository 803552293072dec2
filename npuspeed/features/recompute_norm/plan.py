"""--recompute-norm in `npuspeed plan`: the norm outputs of the selected layers are not held."""
from __future__ import annotations


def effect(model, config):
    from npuspeed.features.first_layers import per_chunk, recompute_effect

    n = config.recompute_norm_num_layers
    return recompute_effect("norm_output", n, f"the input and pre-MLP norm outputs (2 x tokens x hidden) and the "
                            f"norms' statistics of {per_chunk(n)} are not held between forward and backward; one "
                            "norm is recomputed at a time")
