"""All-to-all in flight, as two autograd steps: `start` launches, `finish` waits.

`start(x, ...)` launches `all_to_all_single` with `async_op=True` and returns the output
buffer before it is filled; `finish(y, flight)` waits and hands it on. Whatever runs between
the two overlaps the transfer: on gloo the collective runs on the process group's threads;
on NCCL/HCCL it runs on the backend's communication stream and `wait()` orders the compute
stream after it.

Backward mirrors it: `finish`'s backward launches the reverse all-to-all of the gradient
(into a buffer the flight holds; the gradient itself passes on as a same-shaped token) and
`start`'s backward waits for it and returns that buffer. Autograd runs ready nodes latest-created first, so the
gradient work recorded between the two in forward (the next chunk's experts, the shared
experts) runs while that reverse transfer is in flight.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from npuspeed import telemetry
from npuspeed.features.moe_common import a2a_clock


class Flight:
    """One all-to-all and its mirror in backward: split sizes, the work handles, the inputs kept alive."""

    def __init__(self, group, out_splits: list[int], in_splits: list[int], label: str):
        self.group, self.out_splits, self.in_splits, self.label = group, out_splits, in_splits, label
        self.work = self.grad_work = self.grad_in = None
        self.clock = self.grad_clock = None  # a2a_clock's record of each transfer (the hidden share)
        self.keep = ()

    def launch(self, x: torch.Tensor, out_splits, in_splits, backward: bool = False):
        x = x.contiguous()
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        work = dist.all_to_all_single(out, x, output_split_sizes=list(out_splits),
                                      input_split_sizes=list(in_splits), group=self.group, async_op=True)
        telemetry.count(f"moe.a2a.{self.label}{'.backward' if backward else ''}")
        if backward:
            self.grad_work, self.grad_in, self.keep, self.grad_clock = work, out, (x,), a2a_clock.launch(work)
        else:
            self.work, self.keep, self.clock = work, (x,), a2a_clock.launch(work)
        return out


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, flight):
        ctx.flight = flight
        return flight.launch(x, flight.out_splits, flight.in_splits)

    @staticmethod
    def backward(ctx, _token):
        flight = ctx.flight
        flight.grad_clock.wait(flight.grad_work)
        grad_in = flight.grad_in
        flight.grad_work, flight.grad_in, flight.keep = None, None, ()
        return grad_in, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, flight):
        ctx.flight = flight
        flight.clock.wait(flight.work)
        flight.work, flight.keep = None, ()
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        flight = ctx.flight  # reverse direction: what arrived from each rank goes back to it
        flight.launch(grad, flight.in_splits, flight.out_splits, backward=True)
        return grad, None


def start(x: torch.Tensor, group, out_splits, in_splits, label: str):
    """Launch the all-to-all of `x` (rows `in_splits` to each rank, `out_splits` from each);
    returns (buffer, flight): pass both to `finish` before reading the buffer."""
    flight = Flight(group, [int(s) for s in out_splits], [int(s) for s in in_splits], label)
    return _Start.apply(x, flight), flight


def finish(y: torch.Tensor, flight: Flight) -> torch.Tensor:
    """Wait for the all-to-all that fills `y`; returns it, ready to read."""
    return _Finish.apply(y, flight)
