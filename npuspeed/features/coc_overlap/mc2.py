"""The Ascend MC2 engine: torch_npu's fused communication+matmul kernels (`--use-ascend-mc2`).

`npu_all_gather_base_mm(x, w_t, hcom, world_size, bias=, gather_index=0, gather_output=,
comm_turn=0)` returns (all_gather(x) @ w_t, all_gather(x)); `npu_mm_reduce_scatter_base(x,
w_t, hcom, world_size, reduce_op='sum', bias=, comm_turn=0)` returns reduce_scatter(x @ w_t);
`npu_mm_all_reduce_base(x, w_t, hcom, reduce_op='sum', ...)` returns all_reduce(x @ w_t).
They pipeline internally; rows come out in the unchunked collective's order. `hcom` is the
HCCL communicator name of the tensor-parallel group.

The kernels take fp16/bf16 2-D inputs with k in [256, 65535) on 2, 4 or 8 ranks; any other
call goes to the chunked engine (one log line per shape). The kernels are called by
npuspeed.ops.npu.mc2 on the op library the engine is given, so a unit test can stand a fake in.
"""
from __future__ import annotations

import logging

import torch

from npuspeed import telemetry
from npuspeed.accelerator import npu_ops
from npuspeed.features.coc_overlap.comm import COLLECTIVE, ChunkedEngine, Pending
from npuspeed.ops.npu import mc2 as npu_mc2

log = logging.getLogger("npuspeed")
OPS = (npu_ops.ALL_GATHER_MM, npu_ops.MM_REDUCE_SCATTER)


def hccl_comm_name(group, acc) -> str:
    """The HCCL communicator name torch_npu's MC2 kernels take for `group`."""
    rank = torch.distributed.get_rank()
    return group._get_backend(acc.device()).get_hccl_comm_name(rank)


def unsupported(x: torch.Tensor, w_t: torch.Tensor, world_size: int, op: str = "") -> str | None:
    """Why the MC2 kernel `op` cannot take this call (None when it can), by torch_npu's
    documented limits (the contract tier's emulators enforce the same)."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {x.dtype} (MC2 takes fp16/bf16)"
    if x.dim() != 2 or w_t.dim() != 2:
        return "inputs not 2-D"
    if not 256 <= x.shape[1] < 65535:
        return f"k={x.shape[1]} outside [256, 65535)"
    if world_size not in (2, 4, 8):
        return f"tensor-parallel size {world_size} (MC2 takes 2, 4 or 8)"
    if op == npu_ops.MM_REDUCE_SCATTER and x.shape[0] % world_size:
        return f"m={x.shape[0]} not a multiple of the tensor-parallel size {world_size}"
    return None


class Mc2Engine:
    """Same interface as ChunkedEngine; fused kernels where they apply, chunked elsewhere."""

    name = "mc2"

    def __init__(self, lib, chunked: ChunkedEngine, group, acc):
        # lib: the op library npuspeed.ops.npu.mc2 calls (None: the loaded torch_npu; a test's stand-in)
        self.lib, self.chunked, self.group, self.acc = lib, chunked, group, acc
        self.comm = chunked.comm
        self.size = chunked.comm.size
        self._hcom = None

    @property
    def hcom(self) -> str:
        if self._hcom is None:
            self._hcom = hccl_comm_name(self.group, self.acc)
        return self._hcom

    def _usable(self, op: str, x, w_t) -> bool:
        why = None if npu_mc2.has(self.lib, op) else f"this torch_npu has no {op}"
        why = why or unsupported(x, w_t, self.size, op)
        if why is None:
            telemetry.count(f"{COLLECTIVE}mc2:{op}")
            return True
        if telemetry.once(("coc.mc2", op, tuple(x.shape), x.dtype)):
            log.warning("--use-ascend-mc2: %s for %s %s; this shape runs the chunked path", why,
                        op, tuple(x.shape))
        return False

    def ag_mm(self, x, w_t, keep_gathered: bool = False):
        if not self._usable(npu_ops.ALL_GATHER_MM, x, w_t):
            return self.chunked.ag_mm(x, w_t, keep_gathered)
        out, gathered = npu_mc2.all_gather_mm(self.lib, x.contiguous(), w_t, self.hcom, self.size, keep_gathered)
        return out, (gathered if keep_gathered else None)

    def mm_rs(self, x, w_t) -> Pending:
        if not self._usable(npu_ops.MM_REDUCE_SCATTER, x, w_t):
            return self.chunked.mm_rs(x, w_t)
        return Pending(npu_mc2.mm_reduce_scatter(self.lib, x.contiguous(), w_t, self.hcom, self.size))

    def mm_ar(self, x, w_t) -> Pending:
        if not self._usable(npu_ops.MM_ALL_REDUCE, x, w_t):
            return self.chunked.mm_ar(x, w_t)
        return Pending(npu_mc2.mm_all_reduce(self.lib, x.contiguous(), w_t, self.hcom))
