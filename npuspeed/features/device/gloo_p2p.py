"""Pipeline send/receive on gloo with one tag per direction of travel.

At pipeline-parallel size 2 a stage's previous and next stage are the same rank, and with VPP
one call both sends an activation and a gradient to it. Megatron tells the two apart only by
the order of the operations (batched: send-prev before send-next on the sender, receive-prev
before receive-next on the receiver), which pairs the sender's gradient with the receiver's
activation: gloo matches by (peer, tag), so the tensors arrive swapped, silently (they have
the same shape). On gloo every activation (send-next / receive-prev) travels with one tag and
every gradient (send-prev / receive-next) with another: each lands where Megatron expects it.

Unbatched (`_p2p_ops`: `--overlap-p2p-comm` defers the waits) each send goes out from a copy:
gloo reads a send's memory through the pointer taken when it was posted, and Megatron frees a
sent activation (deallocate_pipeline_outputs: `.data` swapped for a 1-element tensor) before the
deferred wait, so the memory could be reused before gloo had read it (measured: PP2 x VPP2 lost
1e-3 of its first loss). A CUDA stream orders that reuse after the send; a CPU has no stream.
Other backends run Megatron's own functions."""
from __future__ import annotations

import functools

import torch.distributed as dist

P2P = "megatron.core.pipeline_parallel.p2p_communication"
ACTIVATION, GRADIENT = 1, 2  # torch's default tag is 0


def _tagged_ops(send_prev, recv_prev, send_next, recv_next, group, prev_rank, next_rank, own_copy: bool) -> dict:
    reqs = {}
    for key, tensor, op, peer, tag in (
            ("send_next", send_next, dist.isend, next_rank, ACTIVATION),
            ("recv_prev", recv_prev, dist.irecv, prev_rank, ACTIVATION),
            ("send_prev", send_prev, dist.isend, prev_rank, GRADIENT),
            ("recv_next", recv_next, dist.irecv, next_rank, GRADIENT)):
        if tensor is not None:
            if own_copy and op is dist.isend:
                tensor = tensor.detach().clone()  # alive in the request until gloo has sent it
            reqs[key] = op(tensor, peer, group=group, tag=tag)
    return reqs


def tagged_on_gloo(batched: bool):
    """`_batched_p2p_ops` (a list of requests) or `_p2p_ops` (a dict by name) on gloo."""

    def wrap(original):
        @functools.wraps(original)
        def p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
                    prev_pipeline_rank, next_pipeline_rank):
            if dist.get_backend(group) != "gloo":
                return original(tensor_send_prev=tensor_send_prev, tensor_recv_prev=tensor_recv_prev,
                                tensor_send_next=tensor_send_next, tensor_recv_next=tensor_recv_next, group=group,
                                prev_pipeline_rank=prev_pipeline_rank, next_pipeline_rank=next_pipeline_rank)
            reqs = _tagged_ops(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
                               prev_pipeline_rank, next_pipeline_rank, own_copy=not batched)
            return list(reqs.values()) if batched else reqs

        return p2p_ops

    return wrap


def register(registry, feature: str) -> None:
    registry.register(f"{P2P}._batched_p2p_ops", wrapper=tagged_on_gloo(True), feature=feature)
    registry.register(f"{P2P}._p2p_ops", wrapper=tagged_on_gloo(False), feature=feature)
