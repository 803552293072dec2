"""A weight's gradient computed after its input's: the contract between the expert matmuls
(moe_grouped_gemm's grouped mm, moe_fb_overlap's expert linears) and whoever runs the owed
gradients (moe_fb_overlap: between the dispatch gradient's all-to-all launch and its wait), so
neither feature folder imports the other.

While a thread is `arm`ed, `split(w)` hands the matmul `w.detach()` and a `Later` holding the
real `w` (a parameter, or a view or stack of parameters): autograd's graph then has no edge from
the matmul to the weight, so nothing of the weight's (its AccumulateGrad, Megatron DDP's hook on
it) runs in the backward pass. The matmul's backward computes the input's gradient and `owe`s the
weight's as a closure; `run_owed` computes each closure and hands the result to autograd at `w`
(a nested backward through the same view/stack nodes into the same AccumulateGrad, whose hooks
fire as they would have: main_grad's add, DDP's bucket readiness). A closure that accumulated
into main_grad itself (gradient-accumulation fusion) returns Megatron's placeholder, or None.
"""
from __future__ import annotations

import threading

import torch

from npuspeed import telemetry

_LOCAL = threading.local()


def _state():
    if not hasattr(_LOCAL, "armed"):
        _LOCAL.armed, _LOCAL.owed = False, []
    return _LOCAL


def arm(on: bool = True) -> None:
    """Matmuls made on this thread from now on (until `arm(False)`) owe their weight gradients."""
    _state().armed = on


def armed() -> bool:
    return _state().armed and torch.is_grad_enabled()


class Later:
    """The gradient a weight `target` is owed by one matmul's backward."""

    __slots__ = ("target",)

    def __init__(self, target: torch.Tensor):
        self.target = target

    def owe(self, compute) -> None:
        """compute() -> the gradient for `target` (None: nothing to hand autograd); run by the
        next `run_owed` on the thread running this backward."""
        _state().owed.append((compute, self.target))
        telemetry.count("moe.wgrad.owed")


def split(w: torch.Tensor):
    """(w, None) unarmed; armed: (w detached, the Later that carries its gradient)."""
    if not (w.requires_grad and armed()):
        return w, None
    return w.detach(), Later(w)


def owed() -> int:
    return len(_state().owed)


def run_owed() -> int:
    """Compute this thread's owed weight gradients and hand them to autograd; how many ran."""
    state = _state()
    jobs, state.owed = state.owed, []
    targets, grads = [], []
    for compute, target in jobs:
        with torch.no_grad():  # as inside the backward that owed it
            grad = compute()
        if grad is not None:
            targets.append(target)
            grads.append(grad)
    if targets:
        torch.autograd.backward(targets, grads)
    return len(jobs)
