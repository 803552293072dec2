"""Paired or serial, measured on the run's own steps: the flag never makes a step slower.

Whether pairing a forward with a backward pays depends on how much of the step the all-to-alls
take and what the turn changes cost (on a tiny model the hand-overs cost more than the transfers
they hide). No single op can be timed for this, so the run's own steps are (the shared step
trial, npuspeed/ops/choose/step_trial.py). Both paths give the same numbers to the bit; only time
differs. `NPUSPEED_FB_OVERLAP_PATH=paired|serial` forces one. The decision is a record in
`npuspeed report`'s path_choices (chooser "moe_fb_overlap"), and said once in the log.
--moe-fb-overlap's schedules and DualPipeV's paired steps both run their steps through
`trial_step`, one trial per micro-batch count.
"""
from __future__ import annotations

from npuspeed import telemetry
from npuspeed.features.moe_common import a2a_clock
from npuspeed.ops.choose import step_trial
from npuspeed.ops.choose.chooser import Chooser
from npuspeed.ops.choose.step_trial import world_sum

FORCE_ENV = "NPUSPEED_FB_OVERLAP_PATH"
PAIRED, SERIAL = "paired", "serial"
PATHS = step_trial.Paths(on=PAIRED, off=SERIAL, flag="--moe-fb-overlap", off_text="Megatron's serial schedule",
                         on_text="pairing")


def chooser() -> Chooser:
    return step_trial.chooser("moe_fb_overlap", FORCE_ENV, (PAIRED, SERIAL))


def StepTrial(microbatches: int) -> step_trial.StepTrial:  # noqa: N802 (the trial per step count)
    return step_trial.StepTrial(chooser(), "fb_overlap", PATHS, (microbatches,), f"{microbatches} micro-batches")


_TRIALS: dict = {}  # micro-batches -> its step trial


def trial_step(n: int, run, note, paired):
    """One training step of `n` micro-batches as the step trial says (above): Megatron's
    schedule alone (on the clock as `serial`), or inside `paired(acc)`, the context that makes the
    schedule pair its forwards and backwards."""
    from npuspeed.accelerator import get_accelerator

    acc = get_accelerator()
    trial = _TRIALS.setdefault(n, StepTrial(n))
    mode = trial.mode()
    if mode == SERIAL:
        telemetry.count("moe.fb_overlap.serial_steps")
        with a2a_clock.phase("serial"):
            return trial.timed(SERIAL, run, acc.synchronize, world_sum(acc), note)
    telemetry.count("moe.fb_overlap.steps")
    with paired(acc):
        return trial.timed(mode, run, acc.synchronize, world_sum(acc), note)
