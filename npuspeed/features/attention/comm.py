"""The two collectives of context parallelism, counted: ring send/recv and the Ulysses all-to-all.

Every message goes through here and is counted in telemetry (`cp.ring.send`, `cp.ring.recv`,
`cp.ring.bytes`, `cp.all_to_all`, `cp.all_to_all.bytes`), so a test can prove the ring really
passed K/V around and the all-to-all really ran (a path that silently computed locally could
not produce those counts). Sends are asynchronous: the caller starts the next exchange, runs
the current block's attention, then waits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from npuspeed import telemetry

SEND, RECV, RING_BYTES = "cp.ring.send", "cp.ring.recv", "cp.ring.bytes"
A2A, A2A_BYTES = "cp.all_to_all", "cp.all_to_all.bytes"


class RingPeers:
    """Ring neighbours inside one process group (global ranks, as isend/irecv take them)."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.position = dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
        self.next = ranks[(self.position + 1) % self.size]
        self.prev = ranks[(self.position - 1) % self.size]


class Exchange:
    """One in-flight ring step: `send` goes to the next rank, the reply comes from the previous."""

    def __init__(self, peers: RingPeers, send: torch.Tensor, tag: int = 0):
        self.recv = torch.empty_like(send)
        # Receive first: on a 2-rank ring both peers post to each other at once. K/V (tag 0)
        # and the travelling dK/dV (tag 1) may be in flight together between the same peers.
        self._works = [dist.irecv(self.recv, src=peers.prev, group=peers.group, tag=tag),
                       dist.isend(send, dst=peers.next, group=peers.group, tag=tag)]
        self._send = send  # keep alive until the send completes
        telemetry.count(SEND)
        telemetry.count(RECV)
        telemetry.count(RING_BYTES, send.numel() * send.element_size())

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works, self._send = [], None
        return self.recv


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """x [members, ...] contiguous: slice j goes to member j; returns slices from each member."""
    x = x.contiguous()
    out = torch.empty_like(x)  # after contiguous(): empty_like would keep a view's permuted strides
    dist.all_to_all_single(out, x, group=group)
    telemetry.count(A2A)
    telemetry.count(A2A_BYTES, x.numel() * x.element_size())
    return out
