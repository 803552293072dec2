"""Which implementation a fused op runs, and a tally of what actually ran.

Per call of an op's front end: `npu` (torch_npu's fused kernel, through the accelerator) when
the tensors are on an NPU; `cpp` (the `npuspeed::` CPU kernel) for CPU tensors of a supported
dtype when the op library is loaded; otherwise `reference` (the op's pure-PyTorch function).
The flags do not call the front ends blindly: npuspeed.ops.fused_choice measures these
against the device's native op, Triton and Megatron's own path per shape and runs the
fastest (counted as `megatron`, `triton`, `native` too). Each call is counted (telemetry
`ops.<op>.<impl>`, see `calls()`), so tests can prove the fast path ran and a silent
fallback cannot pass; `quiet()` silences the count while the chooser's trials run.

Autograd and fake (meta) kernels of the C++ ops are registered on first use, not at import.
"""
from __future__ import annotations

from typing import Callable

import torch

from npuspeed import telemetry
from npuspeed.ops._extension import has_op
from npuspeed.ops.nesting import Nesting

CPP_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
PREFIX = "ops."
_REGISTERED: set[str] = set()
_QUIET = Nesting()  # inside while a trial or a chosen call runs: record() counts nothing
#: device types whose tensors take torch_npu's kernels: an NPU's; the NPU contract tier
#: (tests/npu_contract/) adds "cpu" so the NPU branches run on CPU tensors through a stand-in
NPU_DEVICE_TYPES = ["npu"]
#: device types whose tensors live in host memory: the `npuspeed::` C++ kernels and Triton's
#: interpreter take them (the ops layer sits below the accelerator, so it keeps this table;
#: npuspeed.accelerator.devices answers from it for everything above)
HOST_DEVICE_TYPES = ["cpu"]
#: the implementation label of torch_npu's kernels (telemetry `ops.<op>.npu`, report keys): a
#: label of what ran, not a device name
NPU_IMPL = "npu"


def calls() -> dict[tuple[str, str], int]:
    """(op, impl) -> calls so far."""
    return {tuple(name[len(PREFIX):].rsplit(".", 1)): n for name, n in telemetry.snapshot(PREFIX).items()}


def reset_calls() -> None:
    telemetry.reset(PREFIX)


def on_npu(*tensors: torch.Tensor) -> bool:
    """All of `tensors` live where torch_npu's kernels run (see NPU_DEVICE_TYPES)."""
    return all(t.device.type in NPU_DEVICE_TYPES for t in tensors)


def on_host(*tensors: torch.Tensor) -> bool:
    """All of `tensors` live in host memory (see HOST_DEVICE_TYPES)."""
    return all(t.device.type in HOST_DEVICE_TYPES for t in tensors)


def implementation(op: str, *tensors: torch.Tensor) -> str:
    """The implementation `op` runs for these tensors: npu, cpp or reference."""
    device_types = {t.device.type for t in tensors}
    one_dtype = len({t.dtype for t in tensors}) == 1
    if on_npu(*tensors) and len(device_types) == 1:
        # torch_npu's fused ops take one dtype (npu_rms_norm: "gamma的数据类型需要和x保持一致")
        return NPU_IMPL if one_dtype else "reference"
    if on_host(*tensors) and all(t.dtype in CPP_DTYPES for t in tensors) and one_dtype and has_op(op):
        return "cpp"
    return "reference"


def record(op: str, impl: str) -> None:
    if not _QUIET.inside:
        telemetry.count(f"{PREFIX}{op}.{impl}")


def counting() -> bool:
    """False inside `quiet()` (other counters of what ran, e.g. MoE's, follow the same rule)."""
    return not _QUIET.inside


def quiet():
    """Count nothing inside (fused_choice's trials; a chosen call is counted by its chooser)."""
    return _QUIET()


def ensure_registered(op: str, register: Callable[[], None]) -> None:
    """Run `register` (autograd + fake kernels of `npuspeed::op`) once per process."""
    if op not in _REGISTERED:
        register()
        _REGISTERED.add(op)


def describe(op: str) -> str:
    """The implementation CPU tensors get, for the report."""
    return "cpp" if has_op(op) else "reference"
