"""The device feature in `npuspeed plan`: nothing. Its patches let megatron.core run on the
chosen accelerator without changing what it computes or keeps; the planner models the device
itself (its memory and kernels), so the feature is plan-neutral."""
from __future__ import annotations


def effect(model, config):
    """None: no slot, kernel, overlap or master changes (see the module docstring)."""
    return None
