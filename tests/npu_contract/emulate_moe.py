"""EMULATOR (not the real op) of torch_npu's npu_grouped_matmul in the non-quantized, Tensor
group_list, m-axis grouped case (group_type=0, split_item 2 or 3: one x, one output), following
`_op_plugin_docs.py` of torch_npu 2.6.0/2.9.0/2.14.0 (same limits in each), and re-exporting the
MoE token permute/unpermute emulators of emulate_permute.py and emulate_permute_grad.py.

Documented limits enforced (Atlas A2/A3, group_list a torch.Tensor):
- x, weight: fp16/bf16/fp32, the same dtype; x one 2-D tensor, not transposed; weight one 3-D
  [E, K, N] tensor ("单单单") or E 2-D [K, N] tensors with equal N ("单多单"), each transposed
  or not alike; the last dim of x and of each weight (N, or K when transposed) < 65536.
- group_list: 1-D int64 with one entry per weight group; at most 1024 groups (128 for a
  weight list); group_list_type 0: non-negative, non-decreasing, last value == x's rows;
  group_list_type 1: non-negative, length not 1, sum == x's rows.
- split_item 2 or 3 with group_type 0.
Not modeled (NotImplementedError): group_type -1 / split_item 0, 1 (multi-tensor x), List[int]
group_list; quantization, bias, activation and output_dtype are not declared, so a stand-in
refuses them. Each group's rows times its weight is computed in fp32 and rounded once.
"""
from __future__ import annotations

import torch

from .emulate_limits import FLOATS, dtype_in, has_values, limit, not_modeled
from .emulate_permute import EMULATORS as _PERMUTE
from .emulate_permute_grad import EMULATORS as _PERMUTE_GRAD

OP = "npu_grouped_matmul"
INNER_LIMIT = 65536


def _transposed(w: torch.Tensor) -> bool:
    return w.dim() >= 2 and w.shape[-2] > 1 and w.stride(-2) == 1 and w.stride(-1) == w.shape[-2]


def _weights(weight):
    if len(weight) == 1 and weight[0].dim() == 3:
        return list(weight[0].unbind(0)), 1024, "单单单 (one 3-D weight)"
    limit(OP, all(w.dim() == 2 for w in weight), "weight must be one 3-D tensor or a list of 2-D tensors")
    limit(OP, len({w.shape[1] for w in weight}) == 1, "every weight's N axis must be equal")
    return list(weight), 128, "单多单 (a weight list)"


def _check_group_list(group_list, group_list_type, groups, rows, most):
    limit(OP, isinstance(group_list, torch.Tensor), "group_list must be a torch.Tensor (List[int] is not modeled)")
    limit(OP, group_list.dim() == 1 and group_list.dtype == torch.int64,
          f"group_list must be 1-D int64, got {group_list.dtype} {tuple(group_list.shape)}")
    n = group_list.numel()
    limit(OP, n == groups, f"group_list length {n} must equal the weight groups {groups}")
    limit(OP, n <= most, f"group_list length {n} exceeds the {most} groups allowed")
    limit(OP, group_list_type in (0, 1), f"group_list_type must be 0 or 1, got {group_list_type}")
    if group_list_type == 1:
        limit(OP, n != 1, "group_list_type=1 (counts): group_list's length cannot be 1")
    if not has_values(group_list):
        return None
    values = group_list.tolist()
    limit(OP, all(v >= 0 for v in values), f"group_list must be non-negative, got {values}")
    if group_list_type == 0:
        limit(OP, all(a <= b for a, b in zip(values, values[1:])),
              f"group_list_type=0: group_list must be non-decreasing, got {values}")
        limit(OP, values[-1] == rows, f"group_list_type=0: the last value {values[-1]} must equal x's rows {rows}")
        return [b - a for a, b in zip([0] + values[:-1], values)]
    limit(OP, sum(values) == rows, f"group_list_type=1: the counts' sum {sum(values)} must equal x's rows {rows}")
    return values


def npu_grouped_matmul(x, weight, *, group_list=None, split_item=0, group_type=None, group_list_type=0):
    if group_type != 0 or split_item not in (2, 3):
        not_modeled(OP, f"group_type={group_type}, split_item={split_item} (only m-axis groups, one output)")
    limit(OP, len(x) == 1, f"group_type=0 with split_item {split_item} takes one x tensor here, got {len(x)}")
    limit(OP, 1 <= len(weight) <= 128, f"weight list length must be 1-128, got {len(weight)}")
    a = x[0]
    dtype_in(OP, "x", a, FLOATS)
    limit(OP, a.dim() == 2, f"x must be 2-D, got {a.dim()}-D")
    limit(OP, a.shape[1] <= 1 or a.stride(-1) == 1, "x must not be transposed")
    ws, most, scene = _weights(weight)
    for w in weight:
        limit(OP, w.dtype == a.dtype, f"weight dtype {w.dtype} must equal x's {a.dtype} (non-quantized)")
    limit(OP, len({_transposed(w) for w in weight}) == 1, "every weight must be transposed alike")
    limit(OP, all(w.shape[0] == a.shape[1] for w in ws), f"each weight's K must equal x's {a.shape[1]}")
    limit(OP, a.shape[1] < INNER_LIMIT, f"x's last dim {a.shape[1]} must be < {INNER_LIMIT}")
    for w in weight:
        last = w.shape[-2] if _transposed(w) else w.shape[-1]
        limit(OP, last < INNER_LIMIT, f"weight's last dim {last} must be < {INNER_LIMIT} ({scene})")
    limit(OP, group_list is not None, "group_type=0 needs a group_list")
    counts = _check_group_list(group_list, group_list_type, len(ws), a.shape[0], most)
    n = ws[0].shape[1]
    if counts is None:  # meta / fake tensors: shapes only
        return [a.new_empty((a.shape[0], n))]
    out = a.new_empty((a.shape[0], n))
    start = 0
    for w, c in zip(ws, counts):
        out[start:start + c] = (a[start:start + c].float() @ w.float()).to(a.dtype)
        start += c
    return [out]


EMULATORS = {OP: npu_grouped_matmul, **_PERMUTE, **_PERMUTE_GRAD}


def emulators(release: str) -> dict:
    """EMULATORS for torch_npu `release` (these ops' outputs are shaped alike in 2.6.0-2.14.0)."""
    return dict(EMULATORS)
