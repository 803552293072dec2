"""Chunked or Megatron's unchunked MoE layer, measured on the run's own steps: the flag never
makes a step slower.

Chunking pays where the experts' compute can hide the chunks' transfers; where the extra
hand-overs and the smaller expert GEMMs cost more (CPU loopback, EP2: 0.93x at one
configuration), Megatron's layer runs. Its effect is on the whole step (the backward's chunks
too), so the step is timed (npuspeed/ops/choose/step_trial.py): every schedule call of
`forward_backward_*` is one step; MoELayer.forward asks `chunked_now()`. A forward-only call
(evaluation) takes the decision made, the chunked path before one. The two paths agree to the
last bits only, so under --deterministic-mode the chunked path runs without a trial.
`NPUSPEED_A2A_OVERLAP_PATH=chunked|megatron` forces one; the decision is a record in `npuspeed
report`'s path_choices (chooser "moe_alltoall_overlap"), and said once in the log.
"""
from __future__ import annotations

import functools
import inspect

from npuspeed import telemetry
from npuspeed.ops.choose import step_trial
from npuspeed.ops.choose.chooser import DETERMINISTIC, Chooser
from npuspeed.ops.choose.record import MEGATRON

FORCE_ENV = "NPUSPEED_A2A_OVERLAP_PATH"
CHUNKED = "chunked"
PATHS = step_trial.Paths(on=CHUNKED, off=MEGATRON, flag="--moe-alltoall-overlap-comm",
                         off_text="Megatron's unchunked MoE layer", on_text="chunking")
SCHEDULES = "megatron.core.pipeline_parallel.schedules"
STEP_FUNCTIONS = ("forward_backward_no_pipelining", "forward_backward_pipelining_with_interleaving",
                  "forward_backward_pipelining_without_interleaving")
_TRIALS: dict[int, step_trial.StepTrial] = {}  # micro-batches -> its trial
_state = {"mode": CHUNKED, "decided": CHUNKED, "depth": 0}


def chooser() -> Chooser:
    return step_trial.chooser("moe_alltoall_overlap", FORCE_ENV, (CHUNKED, MEGATRON))


def chunked_now() -> bool:
    """Whether MoELayer.forward takes the chunked path in this call."""
    return _state["mode"] == CHUNKED


def _trial(n: int) -> step_trial.StepTrial:
    import torch

    trial = _TRIALS.get(n)
    if trial is None:
        untimed = DETERMINISTIC.replace("kernel", "MoE path") if torch.are_deterministic_algorithms_enabled() else ""
        trial = _TRIALS[n] = step_trial.StepTrial(chooser(), "alltoall_overlap", PATHS, (n,), f"{n} micro-batches",
                                                  untimed=untimed)
    return trial


def step_wrapper(note):
    """Around each of Megatron's schedule functions: the step runs as the trial says."""

    def wrap(original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def run(*args, **kwargs):
            if _state["depth"]:  # a schedule inside a schedule: the outer call is the step
                return original(*args, **kwargs)
            call = signature.bind(*args, **kwargs)
            call.apply_defaults()
            from npuspeed.accelerator import get_accelerator

            _state["depth"] += 1
            try:
                if call.arguments.get("forward_only"):
                    _state["mode"] = _state["decided"]
                    return original(*args, **kwargs)
                trial = _trial(int(call.arguments["num_microbatches"]))
                _state["mode"] = mode = trial.mode()
                telemetry.count(f"moe.a2a_overlap.steps_{mode}")
                acc = get_accelerator()
                out = trial.timed(mode, lambda: original(*args, **kwargs), acc.synchronize, step_trial.world_sum(acc),
                                  note)
                made = chooser().choices.get(trial.key)
                if made is not None:
                    _state["decided"] = CHUNKED if made.impl == CHUNKED else MEGATRON
                return out
            finally:
                _state["depth"] -= 1
                _state["mode"] = _state["decided"]

        return run

    return wrap
