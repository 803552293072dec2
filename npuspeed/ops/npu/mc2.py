"""torch_npu's MC2 kernels: a matmul fused with its tensor-parallel collective (HCCL).

`lib`: the op library (`library`: None is the loaded torch_npu; the MC2 tests pass a stand-in).
`hcom` is the HCCL communicator name of the group, `world_size` its size.
"""
from __future__ import annotations

from npuspeed.ops.npu import library


def has(lib, op: str) -> bool:
    """Whether the op library has the MC2 kernel `op`."""
    return hasattr(library(lib), op)


def all_gather_mm(lib, x, w_t, hcom: str, world_size: int, gather_output: bool):
    """(all_gather(x) @ w_t, the gathered x when `gather_output`)."""
    return library(lib).npu_all_gather_base_mm(x, w_t, hcom, world_size, bias=None, gather_index=0,
                                               gather_output=gather_output, comm_turn=0)


def mm_reduce_scatter(lib, x, w_t, hcom: str, world_size: int):
    """reduce_scatter(x @ w_t) over the group's rows."""
    return library(lib).npu_mm_reduce_scatter_base(x, w_t, hcom, world_size, reduce_op="sum", bias=None,
                                                   comm_turn=0)


def mm_all_reduce(lib, x, w_t, hcom: str):
    """all_reduce(x @ w_t)."""
    return library(lib).npu_mm_all_reduce_base(x, w_t, hcom, reduce_op="sum", bias=None, comm_turn=0)
