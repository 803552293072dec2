"""Warm-up and cool-down self-masking: with no other micro-batch beside it, a layer hides its
own combine behind its shared experts.

The shared experts' forward is held back (`shared_experts_compute` returns a `Deferred`) and run
between the combine's launch and its wait (exchange.py's combine), so it computes while the
combine's tokens travel; `postprocess` takes its result, as it would have taken the tensor. In
backward autograd runs ready nodes latest-created first, so the shared experts' backward (made
between the combine's two steps) runs between the combine gradient's launch and its wait: the
cool-down's combine is hidden the same way. Same kernels on the same inputs: only when they run
changes. Megatron 0.16+ (shared_experts_compute and postprocess as separate steps).
"""
from __future__ import annotations

import threading

from npuspeed import telemetry

RANGE = ">=0.16,<0.20"
_PENDING: dict[int, list["Deferred"]] = {}


class Deferred:
    """A shared-experts output not computed yet; `result()` computes it once."""

    def __init__(self, compute, layer, hidden_states):
        self._args = (compute, layer, hidden_states)
        self._out = None
        self._thread = threading.get_ident()
        _PENDING.setdefault(self._thread, []).append(self)

    def result(self):
        if self._args is not None:
            compute, layer, hidden_states = self._args
            self._args = None
            pending = _PENDING.get(self._thread, [])
            if self in pending:  # taken by postprocess where no combine ran it (nothing kept alive)
                pending.remove(self)
            self._out = compute(layer, hidden_states)
        return self._out


def run_pending() -> int:
    """Compute this thread's held-back shared experts now (during a combine); how many ran."""
    pending = _PENDING.pop(threading.get_ident(), [])
    for deferred in pending:
        deferred.result()
    telemetry.count("moe.fb_overlap.shared_during_combine", len(pending))
    return len(pending)


def shared_experts_compute_wrapper(original):
    def shared_experts_compute(self, hidden_states):
        if not self.use_shared_expert or self.shared_expert_overlap:
            return original(self, hidden_states)
        return Deferred(original, self, hidden_states)

    return shared_experts_compute


def postprocess_wrapper(original):
    def postprocess(self, output, shared_expert_output):
        if isinstance(shared_expert_output, Deferred):
            shared_expert_output = shared_expert_output.result()
        return original(self, output, shared_expert_output)

    return postprocess
