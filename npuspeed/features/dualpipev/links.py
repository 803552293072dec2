"""DualPipeV's pipeline sends and receives: asynchronous, one process group per kind.

Between neighbours r and r+1 four streams run: chunk 0's activations down and its gradients
up, chunk 1's activations up and its gradients down. Each direction carries an activation
stream and a gradient stream, which DualPipeV's order interleaves differently on the two ends.
Backends match point-to-point messages by order (NCCL, HCCL) or by peer and tag (gloo), so the
activations travel in one process group and the gradients in another (made once, collectively,
over every pipeline group): in each, each direction carries one stream, in micro-batch order on
both ends, whatever the backend. Sends are posted at once and waited at the end of the step;
receives are posted when the schedule needs them.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

_GROUPS: dict = {}


def _pipeline_groups() -> list[list[int]]:
    """Every pipeline group's global ranks (each rank knows only its own)."""
    from megatron.core import parallel_state

    mine = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return sorted({tuple(g) for g in every})


def groups() -> tuple:
    """(activation group, gradient group) holding this rank's pipeline group's ranks."""
    from megatron.core import parallel_state

    key = tuple(dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()))
    if key not in _GROUPS:
        _GROUPS.clear()
        for ranks in _pipeline_groups():  # every rank creates every group, in one order
            made = (dist.new_group(list(ranks)), dist.new_group(list(ranks)))
            _GROUPS[ranks] = made
    return _GROUPS[key]


class Links:
    """This rank's neighbours on the way down (next) and up (previous), and the step's pending sends."""

    def __init__(self, shape, dtype, device, waited=None):
        from megatron.core import parallel_state

        self.rank = parallel_state.get_pipeline_model_parallel_rank()
        self.size = parallel_state.get_pipeline_model_parallel_world_size()
        ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
        self.down = ranks[self.rank + 1] if self.rank + 1 < self.size else None
        self.up = ranks[self.rank - 1] if self.rank > 0 else None
        self.activations, self.gradients = groups()
        self.shape, self.dtype, self.device = shape, dtype, device
        self.pending = []
        self.waited = waited  # called with each receive's blocked seconds (the bubble measure)

    def send(self, tensor, peer, group) -> None:
        self.pending.append(dist.isend(tensor.contiguous(), dst=peer, group=group))

    def recv(self, peer, group, requires_grad: bool):
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device, requires_grad=requires_grad)
        work = dist.irecv(buf, src=peer, group=group)
        t0 = time.perf_counter()
        work.wait()
        if self.waited is not None:
            self.waited(time.perf_counter() - t0)
        return buf

    # chunk 0 flows down (rank r -> r+1), chunk 1 up (rank r -> r-1); gradients the other way
    def activation_from(self, chunk: int):
        return self.up if chunk == 0 else self.down

    def activation_to(self, chunk: int):
        return self.down if chunk == 0 else self.up

    def finish(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending.clear()
