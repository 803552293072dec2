"""The links an expert all-to-all crosses, per backend: one bandwidth figure inside a node and
one between nodes, so `npuspeed plan` can price the EP all-to-all at any cluster size.

Nominal, not measured here (no device was lent): the datasheet figure per direction times a
practical fraction of what published all-to-all kernels reach on it.
- cuda: an H100 SXM node (8 GPUs): NVLink 4, 450 GB/s per direction, ~75% in an all-to-all
  (DeepEP reached ~153 of H800's 200 GB/s) -> 340 GB/s; between nodes one 400 Gb/s NDR
  InfiniBand NIC per GPU, 50 GB/s, ~45 GB/s achieved (DeepEP: 43-58 GB/s RDMA);
- npu: an Atlas 800T A2 node (8 Ascend 910B): HCCS full mesh, 7 links x 28 GB/s per direction
  = 196 GB/s, ~75% -> 147 GB/s; between nodes one 200 Gb/s RoCE port per NPU, 25 GB/s,
  ~22 GB/s achieved;
- cpu: gloo over the host's loopback (~2 GB/s) and a 10 GbE link between hosts (~1 GB/s).
An unknown backend is priced as cuda's (as recompute_cost.RATES does).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Links:
    intra_name: str
    intra: float  # bytes/s one rank sends to peers in its node
    inter_name: str
    inter: float  # bytes/s one rank sends to other nodes
    latency: float  # seconds per collective call


LINKS = {
    "cuda": Links("NVLink 4", 340e9, "400 Gb/s InfiniBand", 45e9, 20e-6),
    "npu": Links("HCCS", 147e9, "200 Gb/s RoCE", 22e9, 30e-6),
    "cpu": Links("gloo loopback", 2e9, "10 GbE", 1e9, 100e-6),
}


def links_for(backend: str) -> Links:
    return LINKS.get(backend, LINKS["cuda"])


def all_to_all_seconds(links: Links, nbytes: float, group: int, ranks_per_node: int) -> float:
    """Seconds one all-to-all takes where each rank holds `nbytes` spread evenly over a group of
    `group` consecutive ranks, `ranks_per_node` to a node: the share for peers in the node over
    the node's links and the share for other nodes over the network, at once."""
    if group < 2:
        return 0.0
    local = max(min(group, ranks_per_node), 1)
    inside = nbytes * (local - 1) / group
    outside = nbytes * (group - local) / group
    return links.latency + max(inside / links.intra, outside / links.inter)
