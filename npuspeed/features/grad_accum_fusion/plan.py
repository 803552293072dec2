"""--gradient-accumulation-fusion in `npuspeed plan`: none. The planner models neither the
weight-gradient temporary nor its add (a transient of one layer's weight size), and the time is
at most the unfused one by the chooser's rule (the feature is plan_neutral)."""
from __future__ import annotations


def effect(model, config):
    """None: nothing the planner models changes (see the module docstring)."""
    return None
