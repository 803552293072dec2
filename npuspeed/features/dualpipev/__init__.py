"""DualPipeV (`--schedules-method dualpipev`): the feature and its flag (dualpipev_feature.py),
the V placement of the layers (placement.py), each rank's order (order.py), the sends and
receives (links.py), the step (run.py), Megatron's schedule function routed to it
(schedule.py), its patches (patches.py) and its plan effect (plan.py)."""
from npuspeed.features.dualpipev.dualpipev_feature import DualPipeVFeature

__all__ = ["DualPipeVFeature"]
