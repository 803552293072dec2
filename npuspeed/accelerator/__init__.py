"""`get_accelerator()`: the one object that answers device questions.

Choice: `NPUSPEED_DEVICE` (npu | cuda | cpu) if set, else an NPU when torch_npu imports
and sees a device, else CUDA when available, else the CPU. torch_npu is imported lazily
because, installed on a machine without CANN, it breaks `import torch` for everyone.
"""
from __future__ import annotations

import logging
import os

import torch

from npuspeed.accelerator.base import Accelerator, AcceleratorError, NullEvent, NullStream
from npuspeed.accelerator.devices import for_device

log = logging.getLogger("npuspeed")

DEVICES = ("npu", "cuda", "cpu")
_ACCELERATOR: Accelerator | None = None


def _cuda_present() -> bool:
    """torch's own answer, never the CPU shim's (which says True to Megatron): the shim
    keeps torch's function as `_npuspeed_torch_original`, so detection never feeds back."""
    is_available = torch.cuda.is_available
    return bool(getattr(is_available, "_npuspeed_torch_original", is_available)())


def _npu_present() -> bool:
    try:
        from npuspeed.accelerator.npu import import_torch_npu

        import_torch_npu()
        return bool(torch.npu.is_available() and torch.npu.device_count() > 0)
    except Exception:  # not importable and importable-without-device are alike
        return False


def _build(name: str) -> Accelerator:
    if name == "npu":
        try:
            from npuspeed.accelerator.npu import NpuAccelerator

            acc = NpuAccelerator()
        except ImportError as exc:
            raise AcceleratorError(
                f"NPUSPEED_DEVICE=npu needs torch_npu, which failed to import ({exc}). "
                "Install it with `pip install npuspeed[npu]` on a machine with CANN, "
                "or unset NPUSPEED_DEVICE to use the detected device."
            ) from exc
        from npuspeed.accelerator.npu_ops import release_problem

        problem = release_problem(acc.torch_npu)
        if problem:
            raise AcceleratorError(problem)
        if not acc.is_available():
            raise AcceleratorError("NPUSPEED_DEVICE=npu but torch_npu sees no NPU device.")
        return acc
    if name == "cuda":
        if not getattr(torch.backends, "cuda", None) or not _cuda_present():
            raise AcceleratorError("NPUSPEED_DEVICE=cuda but this torch build sees no CUDA device.")
        from npuspeed.accelerator.cuda import CudaAccelerator

        return CudaAccelerator()
    from npuspeed.accelerator.cpu import CpuAccelerator

    return CpuAccelerator()


def select_device_name() -> str:
    requested = os.environ.get("NPUSPEED_DEVICE", "").strip().lower()
    if requested:
        if requested not in DEVICES:
            raise AcceleratorError(
                f"NPUSPEED_DEVICE={requested!r} is not a known device; use one of "
                f"{', '.join(DEVICES)} or unset it for auto-detection."
            )
        return requested
    if _npu_present():
        return "npu"
    if _cuda_present():
        return "cuda"
    return "cpu"


def get_accelerator() -> Accelerator:
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = _build(select_device_name())
    return _ACCELERATOR


def reset_accelerator() -> None:
    """Forget the cached choice (tests switch NPUSPEED_DEVICE)."""
    global _ACCELERATOR
    _ACCELERATOR = None


__all__ = [
    "Accelerator",
    "AcceleratorError",
    "DEVICES",
    "NullEvent",
    "NullStream",
    "for_device",
    "get_accelerator",
    "reset_accelerator",
    "select_device_name",
]
