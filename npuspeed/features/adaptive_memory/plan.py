"""--adaptive-recompute-device-size in `npuspeed plan`: none of its own. The policy becomes the
flags of other features (plan/adaptive.py) before planning, and their effects are counted;
counting it here too would count them twice (the feature is plan_neutral)."""
from __future__ import annotations


def effect(model, config):
    """None: the flags the policy set carry the effect (see the module docstring)."""
    return None
