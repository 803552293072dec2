"""DualPipeV (`--schedules-method dualpipev`): the feature and its flag (dualpipev_feature.py),
the sends and receives (links.py), the step (run.py), Megatron's schedule function routed to it
(schedule.py), its patches (patches.py) and its plan effect (plan.py). The V placement of the
layers (v_placement.py) and each rank's order (v_order.py), which the planner and Megatron-LM's
reporting rank use too, are in the shared room `features/pipeline/`, with what DualPipeV shares
with --moe-fb-overlap (turns, the step trial, the chunk runners, the bubble measure)."""
from npuspeed.features.dualpipev.dualpipev_feature import DualPipeVFeature

__all__ = ["DualPipeVFeature"]
