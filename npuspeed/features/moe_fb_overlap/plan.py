"""--moe-fb-overlap in `npuspeed plan`: with m micro-batches a step runs m - 1 forward/backward
pairs; in each, one micro-batch's forward all-to-alls hide behind the other's backward compute
and the other way round, each only up to the compute beside it, which the planner prices at the
device's rates (npuspeed/plan/fb_overlap.py): the first forward's and the last backward's stay
exposed. Micro-batch i's backward runs beside i+1's forward, so at PP 1 two micro-batches'
activations are alive at once: one more than Megatron's forward-then-backward."""
from __future__ import annotations


def effect(spec, config):
    from npuspeed.features.base import PlanEffect

    if not spec.model.num_experts:
        return None
    m = spec.batch.num_microbatches(spec.layout.dp)
    pairs = max(m - 1, 0)
    return PlanEffect(fb_pairs=pairs, extra_in_flight=1 if m > 1 else 0,
                      summary=f"expert all-to-alls behind another micro-batch's compute: {pairs} forward/backward "
                              f"pairs of {m} micro-batches, at most {pairs / m:.0%} of their time hidden (each "
                              "up to the compute beside it: the --moe-fb-overlap line below); one more "
                              "micro-batch's activations held")
