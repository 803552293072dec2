"""One weight's gradient summed in place over several grouped matmuls of a step: the contract
between the chunked all-to-all (moe_alltoall_overlap runs the experts once per chunk) and the
grouped experts (moe_grouped_gemm's grouped_mm adds each chunk's weight gradient into the sum,
see its module docstring), so neither feature folder imports the other."""
from __future__ import annotations

import torch


class GradSink:
    """The weight gradient of `expected` grouped matmuls of one weight, summed in place."""

    def __init__(self, expected: int):
        self.expected, self.seen, self.grad = expected, 0, None

    def take(self, x, grad, counts, w, fresh):
        """This call's weight gradient: added into the sum; the sum once every call gave one."""
        if self.grad is None:
            self.grad = fresh()
        else:
            for g, (xs, gs) in enumerate(zip(x.split(counts), grad.split(counts))):
                if xs.shape[0]:
                    torch.addmm(self.grad[g], xs.t(), gs, out=self.grad[g])
        self.seen += 1
        if self.seen < self.expected:
            return None
        total, self.grad = self.grad, None
        return total


def share_weight_grads(experts, calls: int):
    """Before `calls` forward calls of one GroupedMLP in a step (chunks): their weight
    gradients are summed in place (GradSink); returns the undo. Other experts: nothing to do."""
    if calls < 2 or not (hasattr(experts, "weight1") or getattr(experts, "npuspeed_grouped", False)):
        return lambda: None
    experts.npuspeed_grad_sinks = (GradSink(calls), GradSink(calls))

    def undo():
        experts.__dict__.pop("npuspeed_grad_sinks", None)

    return undo
