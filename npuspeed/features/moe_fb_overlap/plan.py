"""--moe-fb-overlap in `npuspeed plan`: with m micro-batches a step runs m-1 forward/backward
pairs; each pair hides the forward all-to-alls of one micro-batch and the backward ones of
another, so all but the first forward's and the last backward's are hidden: (m-1)/m of the
expert all-to-all time (forward and backward move the same bytes)."""
from __future__ import annotations


def effect(spec, config):
    from npuspeed.features.base import PlanEffect

    if not spec.model.num_experts:
        return None
    m = spec.batch.num_microbatches(spec.layout.dp)
    hidden = (m - 1) / m if m > 1 else 0.0
    return PlanEffect(overlap={"ep": hidden},
                      summary=f"expert all-to-alls behind another micro-batch's compute: {m - 1} forward/backward "
                              f"pairs of {m} micro-batches, up to {hidden:.0%} of their time hidden")
