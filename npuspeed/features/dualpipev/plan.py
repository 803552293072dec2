"""--schedules-method dualpipev in `npuspeed plan`: none yet. The planner simulates Megatron's
orders (plan/schedule.py) and places the embedding and the output layer on the first and last
pipeline ranks; it does not model the V order or rank 0 holding both ends, so a plan with this
flag predicts the interleaved schedule's step (stated here rather than guessed)."""
from __future__ import annotations


def effect(model, config):
    """None: see the module docstring."""
    return None
