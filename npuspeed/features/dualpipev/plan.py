"""--schedules-method dualpipev in `npuspeed plan`: the V schedule (PlanEffect.schedule).

The planner then places the stages in the V (npuspeed/plan/placement.py: rank 0 holds the
embedding and the output layer with the loss, their parameters, memory and time) and runs each
rank's order of pipeline/v_order.py in its step simulation and its memory walk (npuspeed/plan/schedule.py).
DeepSeek's DualPipe README gives the bubble as (PP/2 - 1)(F&B + B - 3W) for PP stages, here
(P - 1)(F&B + B - 3W) for P ranks holding 2P stages; W = 0 here, as no dense weight-gradient
split exists (F, B: one chunk's forward and backward; F&B: a paired step's, F + B unless
--moe-fb-overlap hides its all-to-alls)."""
from __future__ import annotations

from npuspeed.features.pipeline import v_order


def paired_steps(ranks: int, rank: int, microbatches: int) -> int:
    """Paired steps (a forward beside a backward) of one rank's order; 0 below 2P micro-batches."""
    if microbatches < 2 * ranks:
        return 0
    return sum(op.paired for _, op in v_order.schedule(ranks, rank, microbatches))


def effect(model, config):
    from npuspeed.features.base import PlanEffect

    p, m = model.layout.pp, model.batch.num_microbatches(model.layout.dp)
    return PlanEffect(schedule="dualpipev", summary=(
        f"V placement: rank r holds stages r and {2 * p - 1}-r (embedding and loss on rank 0), DualPipeV's "
        f"order with {paired_steps(p, 0, m)} paired steps on rank 0; bubble (P-1)(F&B + B - 3W) = "
        f"{p - 1} x (F&B + B) (DeepSeek's DualPipe README; W = 0: no weight-gradient split)"))
