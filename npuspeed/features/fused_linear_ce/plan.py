"""--use-fused-linear-cross-entropy in `npuspeed plan`: the output layer's logits are never held whole."""
from __future__ import annotations


def effect(model, config):
    from npuspeed.features.base import PlanEffect

    return PlanEffect(variants={"head": "chunked"},
                      summary="the output layer's logits, their fp32 softmax and gradient (tokens x V/TP "
                              "each) are never held: one chunk at a time, plus an fp32 log-sum-exp per token")
