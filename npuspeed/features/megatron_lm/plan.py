"""Megatron-LM in `npuspeed plan`: nothing. Its patches are plumbing (the parser, argument
validation, megatron.training's CUDA calls on the accelerator): a run's memory and time are
those of megatron.core, which the planner models, so the feature is plan-neutral."""
from __future__ import annotations


def effect(model, config):
    """None: no slot, kernel, overlap or master changes (see the module docstring)."""
    return None
