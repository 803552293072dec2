"""NPU kernel front ends: the only code outside npuspeed/accelerator/ that calls torch_npu.

Each module here wraps torch_npu ops with the arguments npuspeed passes them (the NPU
contract tier binds every call in this folder to each release's schema). `library(lib)` is
the op library a call uses: `lib` when given (an accelerator's module, or a test's stand-in),
else the torch_npu the accelerator loaded. NPU tensors exist only once the accelerator
imported torch_npu, so this reads it from sys.modules instead of importing anything.
"""
from __future__ import annotations

import sys


def library(lib=None):
    """The torch_npu op library to call: `lib`, else the loaded torch_npu."""
    if lib is not None:
        return lib
    module = sys.modules.get("torch_npu")
    if module is None:
        raise RuntimeError("npuspeed: an NPU op was called but torch_npu is not loaded")
    return module


def of(accelerator):
    """The op library of `accelerator` (None off an NPU backend)."""
    return getattr(accelerator, "torch_npu", None)


def has(accelerator, op: str) -> bool:
    """Whether `accelerator`'s op library has `op` (False off an NPU backend)."""
    return hasattr(of(accelerator), op) if of(accelerator) is not None else False
