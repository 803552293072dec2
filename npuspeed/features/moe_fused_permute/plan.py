"""--use-fused-moe-token-permute-and-unpermute in `npuspeed plan`: the fused ops keep the tensors
Megatron's unfused permute keeps (the rows and the sorted index), so memory is the same; time is
in the calibrated layer (the worker runs them)."""
from __future__ import annotations


def effect(model, config):
    from npuspeed.features.base import PlanEffect

    if not model.model.num_experts:
        return None
    return PlanEffect(summary="token permute/unpermute as one op each way: same saved tensors (rows, sorted "
                              "index), fewer passes over them")
