"""EMULATOR (not the real op) of torch_npu's MC2 fused communication + matmul kernels and of the
ATB kernel _npu_matmul_add_fp32, over torch.distributed (gloo in tests).

MC2 follows `_op_plugin_docs.py` of torch_npu 2.6.0/2.9.0/2.14.0 (the non-quantized case, the
same limits in each): input and x2 2-D fp16/bf16 of one dtype, (m, k) @ (k, n), k in
[256, 65535), input not transposed (x2 may be), world_size 2, 4 or 8 (Atlas A2; A3 adds 16),
bias unsupported ("bias input non-0 is not supported"), gather_index 0 and comm_turn 0 only,
reduce_op 'sum' only, npu_mm_reduce_scatter_base: m divisible by world_size;
npu_mm_all_reduce_base: x1 2-D or 3-D, x2 2-D, a group of 1, 2, 4 or 8 ranks (its bias and
quantization are not declared, so a stand-in refuses them). `hcom` names a process group:
`register_group(group)` gives the name, as get_hccl_comm_name would on an NPU (any
torch.distributed ProcessGroup: its own allgather/allreduce run the collective).

_npu_matmul_add_fp32(x, weight, C): C += x^T @ weight in place, C fp32 [n, k], x [rows, n],
weight [rows, k] of one dtype fp16/bf16. torch_npu documents no ATB op; the orientation is
op-plugin's own test (mm(x.T, weight) + c, LinearParam transposeA=true), the dtypes are its
callers' (vllm-ascend's warm-up, npuspeed's grad-accumulation fusion, MindSpeed's).
"""
from __future__ import annotations

import torch

from .emulate_limits import HALVES, dtype_in, limit

WORLD_SIZES = (2, 4, 8)
_GROUPS: dict[str, object] = {}


def register_group(group) -> str:
    """The `hcom` name the emulated MC2 ops resolve to `group`."""
    for known, g in _GROUPS.items():
        if g is group:
            return known
    name = f"emulated_hcom_{len(_GROUPS)}"
    _GROUPS[name] = group
    return name


def _group(op, hcom):
    limit(op, hcom in _GROUPS, f"hcom {hcom!r} names no registered communicator (register_group)")
    return _GROUPS[hcom]


def _check_mm(op, a, x2, name="input"):
    for n, t in ((name, a), ("x2", x2)):
        dtype_in(op, n, t, HALVES)
        limit(op, t.dim() == 2, f"{n} must be 2-D, got {t.dim()}-D")
    limit(op, x2.dtype == a.dtype, f"x2 dtype {x2.dtype} must equal {name}'s {a.dtype}")
    limit(op, a.shape[1] == x2.shape[0], f"{name} (m, k) {tuple(a.shape)} and x2 (k, n) {tuple(x2.shape)} must share k")
    limit(op, 256 <= a.shape[1] < 65535, f"k={a.shape[1]} must lie in [256, 65535)")
    limit(op, a.shape[1] <= 1 or a.stride(-1) == 1, f"{name} must not be transposed")


def _check_comm(op, hcom, world_size, bias, comm_turn):
    group = _group(op, hcom)
    limit(op, world_size in WORLD_SIZES, f"world_size must be one of {WORLD_SIZES}, got {world_size}")
    limit(op, group.size() == world_size, f"world_size {world_size} must be hcom's size {group.size()}")
    limit(op, bias is None, "bias is not supported (must be None)")
    limit(op, comm_turn == 0, f"comm_turn must be 0, got {comm_turn}")
    return group


def npu_all_gather_base_mm(self, x2, hcom, world_size, *, bias=None, gather_index=0, gather_output=True, comm_turn=0):
    op = "npu_all_gather_base_mm"
    _check_mm(op, self, x2)
    group = _check_comm(op, hcom, world_size, bias, comm_turn)
    limit(op, gather_index == 0, f"gather_index must be 0, got {gather_index}")
    parts = [torch.empty_like(self, dtype=torch.float32) for _ in range(world_size)]
    group.allgather([parts], [self.float().contiguous()]).wait()  # fp32 on the wire: exact for fp16/bf16
    gathered = torch.cat(parts).to(self.dtype)
    out = (gathered.float() @ x2.float()).to(self.dtype)
    return out, (gathered if gather_output else self.new_empty(0))


def npu_mm_reduce_scatter_base(self, x2, hcom, world_size, *, reduce_op="sum", bias=None, comm_turn=0):
    op = "npu_mm_reduce_scatter_base"
    _check_mm(op, self, x2)
    group = _check_comm(op, hcom, world_size, bias, comm_turn)
    limit(op, reduce_op == "sum", f"reduce_op must be 'sum', got {reduce_op!r}")
    limit(op, self.shape[0] % world_size == 0, f"m={self.shape[0]} must be divisible by world_size {world_size}")
    total = self.float() @ x2.float()
    group.allreduce([total]).wait()
    rows = self.shape[0] // world_size
    rank = group.rank()
    return total[rank * rows:(rank + 1) * rows].to(self.dtype)


def npu_mm_all_reduce_base(x1, x2, hcom, *, reduce_op="sum", comm_turn=0):
    op = "npu_mm_all_reduce_base"
    group = _group(op, hcom)
    for n, t in (("x1", x1), ("x2", x2)):
        dtype_in(op, n, t, HALVES)
        limit(op, t.numel() > 0, f"{n} must not be empty")
    limit(op, x1.dim() in (2, 3) and x2.dim() == 2, f"x1 must be 2-D or 3-D and x2 2-D, got {x1.dim()}-D, {x2.dim()}-D")
    limit(op, x2.dtype == x1.dtype, f"x2 dtype {x2.dtype} must equal x1's {x1.dtype}")
    limit(op, x1.shape[-1] == x2.shape[0], f"x1's k {x1.shape[-1]} must equal x2's first dim {x2.shape[0]}")
    limit(op, x1.shape[-1] <= 1 or x1.stride(-1) == 1, "x1 must not be transposed")
    size = group.size()
    limit(op, size in (1, 2, 4, 8), f"the communicator must hold 1, 2, 4 or 8 ranks, got {size}")
    limit(op, reduce_op == "sum", f"reduce_op must be 'sum', got {reduce_op!r}")
    limit(op, comm_turn == 0, f"comm_turn must be 0, got {comm_turn}")
    total = x1.float() @ x2.float()
    group.allreduce([total]).wait()
    return total.to(x1.dtype)


def _npu_matmul_add_fp32(x, weight, C):
    op = "_npu_matmul_add_fp32"
    dtype_in(op, "x", x, HALVES)
    limit(op, weight.dtype == x.dtype, f"weight dtype {weight.dtype} must equal x's {x.dtype}")
    limit(op, C.dtype == torch.float32, f"C must be float32, got {C.dtype}")
    limit(op, x.dim() == 2 and weight.dim() == 2 and x.shape[0] == weight.shape[0],
          f"x [rows, n] and weight [rows, k] must be 2-D with equal rows, got {tuple(x.shape)}, {tuple(weight.shape)}")
    limit(op, tuple(C.shape) == (x.shape[1], weight.shape[1]),
          f"C must be [n, k] = {(x.shape[1], weight.shape[1])}, got {tuple(C.shape)}")
    C.add_(x.float().t() @ weight.float())
    return None


EMULATORS = {f.__name__: f for f in (npu_all_gather_base_mm, npu_mm_reduce_scatter_base, npu_mm_all_reduce_base,
                                     _npu_matmul_add_fp32)}


def emulators(release: str) -> dict:
    """EMULATORS for torch_npu `release` (these ops' outputs are shaped alike in 2.6.0-2.14.0)."""
    return dict(EMULATORS)
