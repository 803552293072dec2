"""The host<->device link each backend copies over: one figure per backend.

Read by everything that prices a copy to or from host memory (the optimizer and attention
swaps' plan effects, the planner's recompute/swap cost), so two parts of npuspeed never price
the same copy differently. Not measured on a device here (none was lent): cuda is PCIe 5 x16
with pinned buffers (~25 GB/s achieved of 64), npu an Ascend 910B's host link (~20 GB/s),
cpu a memcpy within host memory (the swaps save nothing there; ~5 GB/s single-threaded).
"""
from __future__ import annotations

HOST_LINK_BYTES_PER_S = {"cuda": 25e9, "npu": 20e9, "cpu": 5e9}


def host_link_bytes_per_s(backend: str) -> float:
    """The figure for `backend` (a torch device type); an unknown one is a clear error."""
    try:
        return HOST_LINK_BYTES_PER_S[backend]
    except KeyError:
        raise ValueError(f"no host-link figure for backend {backend!r}: "
                         f"add it to npuspeed/accelerator/host_link.py") from None
