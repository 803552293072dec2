"""--moe-fb-overlap in `npuspeed plan`: with m micro-batches a step runs m - 1 forward/backward
pairs at PP 1, and at PP > 1 (VPP v) m x v chunk steps less the interleaved warm-up, counted in
chunks (pairs_of); in each, one micro-batch's forward all-to-alls hide behind the other's backward compute
and the other way round, each only up to the compute beside it, which the planner prices at the
device's rates (npuspeed/plan/fb_overlap.py): the first forward's and the last backward's stay
exposed. Micro-batch i's backward runs beside i+1's forward, so at PP 1 two micro-batches'
activations are alive at once: one more than Megatron's forward-then-backward."""
from __future__ import annotations


def pairs_of(m: int, pp: int, chunks: int) -> tuple[int, int]:
    """(paired steps, chunk-micro-batches) on the first pipeline rank, the one with the longest
    warm-up: PP 1 pairs all but the first forward; PP > 1 runs Megatron's interleaved warm-up,
    (PP-1) x 2 + (v-1) x PP forwards, plus the one extra micro-batch the pairing needs."""
    steps = m * chunks
    warm_up = 1 if pp == 1 else (pp - 1) * 2 + (chunks - 1) * pp + 1
    return max(steps - min(warm_up, steps), 0), steps


def effect(model, config):
    from npuspeed.features.base import PlanEffect

    if not model.model.num_experts:
        return None
    m = model.batch.num_microbatches(model.layout.dp)
    pairs, steps = pairs_of(m, model.layout.pp, model.layout.chunks)
    return PlanEffect(fb_pairs=pairs, extra_in_flight=1 if m > 1 else 0,
                      summary=f"expert all-to-alls behind another micro-batch's compute: {pairs} forward/backward "
                              f"pairs of {steps} chunk-micro-batches, at most {pairs / max(steps, 1):.0%} of their "
                              "time hidden (each "
                              "up to the compute beside it: the --moe-fb-overlap line below); one more "
                              "micro-batch's activations held")
