"""What the fused-op chooser's trials must leave as they found it, on the run's accelerator.

npuspeed.ops.fused_choice times each candidate on copies of a call's inputs inside the real
forward. The ops layer knows nothing of the accelerator or Megatron, so the features hand it
this guard: the device and host random states, Megatron's model-parallel RNG tracker and
the memory peaks are put back after the trials (as fused attention's fallback trial does),
and `synchronize` so device timings are real.
"""
from __future__ import annotations

import contextlib

import torch


class AcceleratorGuard:
    def __init__(self, accelerator):
        self.acc = accelerator

    @contextlib.contextmanager
    def __call__(self):
        acc = self.acc
        tracker_states = None
        try:
            from megatron.core import tensor_parallel

            tracker = tensor_parallel.get_cuda_rng_tracker()
            tracker_states = {name: state.clone() for name, state in tracker.get_states().items()}
        except Exception:  # noqa: BLE001 - no Megatron (bare op use): nothing to put back
            tracker = None
        device_state = acc.get_rng_state().clone()
        host_state = torch.get_rng_state()
        peak, peak_reserved = acc.max_memory_allocated(), acc.max_memory_reserved()
        try:
            yield
        finally:
            if tracker is not None:
                tracker.set_states(tracker_states)
            acc.set_rng_state(device_state)
            torch.set_rng_state(host_state)
            if acc.name == "cpu":
                from npuspeed.ops import memory_tracker

                memory_tracker.restore_peak(peak, peak_reserved)


def configure(ctx) -> None:
    """Point the process's fused-op chooser at this run's accelerator and note sink (idempotent)."""
    from npuspeed.ops import fused_choice

    fused_choice.CHOOSER.configure(sync=ctx.accelerator.synchronize, guard=AcceleratorGuard(ctx.accelerator),
                                   notify=ctx.note)


def choice_lines(op: str) -> str:
    """"; op [shape]: impl (why)" for each measured choice of `op` so far ("" if none)."""
    from npuspeed.ops import fused_choice

    made = [c.line() for c in fused_choice.choices() if c.op == op]
    return "; " + "; ".join(made) if made else ""
