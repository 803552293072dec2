"""--recompute-activation-function in `npuspeed plan`: the MLP activation of the selected layers is
not held between forward and backward."""
from __future__ import annotations


def effect(model, config):
    from npuspeed.features.first_layers import per_chunk, recompute_effect

    n = config.recompute_activation_function_num_layers
    return recompute_effect("mlp_activation", n, f"the MLP activation output (tokens x ffn/TP) of {per_chunk(n)} "
                            "is not held between forward and backward; one layer's copy is recomputed in backward")
