"""Paired or serial, measured on the run's own steps: the flag never makes a step slower.

Whether pairing a forward with a backward pays depends on how much of the step the all-to-alls
take and what the turn changes cost (on a tiny model the hand-overs cost more than the transfers
they hide). No single op can be timed for this, so the run's own steps are (the shared step
trial, npuspeed/ops/choose/step_trial.py). Both paths give the same numbers to the bit; only time
differs. `NPUSPEED_FB_OVERLAP_PATH=paired|serial` forces one. The decision is a record in
`npuspeed report`'s path_choices (chooser "moe_fb_overlap"), and said once in the log.
"""
from __future__ import annotations

from npuspeed.ops.choose import step_trial
from npuspeed.ops.choose.chooser import Chooser

FORCE_ENV = "NPUSPEED_FB_OVERLAP_PATH"
PAIRED, SERIAL = "paired", "serial"
PATHS = step_trial.Paths(on=PAIRED, off=SERIAL, flag="--moe-fb-overlap", off_text="Megatron's serial schedule",
                         on_text="pairing")


def chooser() -> Chooser:
    return step_trial.chooser("moe_fb_overlap", FORCE_ENV, (PAIRED, SERIAL))


def StepTrial(microbatches: int) -> step_trial.StepTrial:  # noqa: N802 (the trial per step count)
    return step_trial.StepTrial(chooser(), "fb_overlap", PATHS, (microbatches,), f"{microbatches} micro-batches")
