"""Which implementation a fused op runs, and a tally of what actually ran.

Per call: `npu` (torch_npu's fused kernel, through the accelerator) when the tensors are on
an NPU; `cpp` (the `npuspeed::` CPU kernel) for CPU tensors of a supported dtype when the op
library is loaded; otherwise `reference` (the op's pure-PyTorch function, also what CUDA
runs). `CALLS[(op, impl)]` counts calls, so tests can prove the fast path ran and a silent
fallback cannot pass; `reset_calls()` clears it.

Autograd and fake (meta) kernels of the C++ ops are registered on first use, not at import.
"""
from __future__ import annotations

import collections
from typing import Callable

import torch

from npuspeed.ops._extension import has_op

CPP_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
CALLS: collections.Counter = collections.Counter()
_REGISTERED: set[str] = set()


def reset_calls() -> None:
    CALLS.clear()


def implementation(op: str, *tensors: torch.Tensor) -> str:
    """The implementation `op` runs for these tensors: npu, cpp or reference."""
    device_types = {t.device.type for t in tensors}
    if device_types == {"npu"}:
        return "npu"
    if (device_types == {"cpu"} and all(t.dtype in CPP_DTYPES for t in tensors)
            and len({t.dtype for t in tensors}) == 1 and has_op(op)):
        return "cpp"
    return "reference"


def record(op: str, impl: str) -> None:
    CALLS[(op, impl)] += 1


def torch_npu():
    """torch_npu, through the accelerator (the only place that imports it)."""
    from npuspeed.accelerator import get_accelerator

    return get_accelerator().torch_npu


def ensure_registered(op: str, register: Callable[[], None]) -> None:
    """Run `register` (autograd + fake kernels of `npuspeed::op`) once per process."""
    if op not in _REGISTERED:
        register()
        _REGISTERED.add(op)


def describe(op: str) -> str:
    """The implementation CPU tensors get, for the report."""
    return "cpp" if has_op(op) else "reference"
