"""Run a Megatron function written for CUDA on the accelerator's device.

Megatron creates tensors with `device='cuda'`, moves them with `.cuda()` and checks
`param.type() == 'torch.cuda.FloatTensor'`. Two scopes, one mapping of `.cuda()`:

- `tensor_cuda_on(device)`: for the block only, `torch.Tensor.cuda` itself answers with
  `.to(device)` (`nn.Module.cuda` goes through it too). No per-op hook, so it suits
  functions that run a whole model (megatron.training's `evaluate`, `get_model`).
- `CudaToDevice(device)` / `on_device(fn)`: that, plus a TorchFunctionMode mapping device
  arguments naming CUDA onto the accelerator and answering `.type()` of its tensors with
  the CUDA type name Megatron expects. Applied to named functions (optimizer set-up, grad
  clipping, ...), never to a whole model: a mode hooks every op.
Both are re-entrant and restore everything on exit, also on an exception.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

from npuspeed.accelerator.devices import for_device, names_cuda
from npuspeed.patching.wrappers import within

_lock = threading.Lock()
_depth = 0
_original_cuda = None


def _make_cuda(device):
    def cuda(self, device_arg=None, non_blocking=False, memory_format=torch.preserve_format, **_kw):
        return self.to(device, non_blocking=non_blocking, memory_format=memory_format)

    cuda.__qualname__ = "npuspeed_tensor_cuda_to_device"
    return cuda


@contextlib.contextmanager
def tensor_cuda_on(device):
    """Within the block, `tensor.cuda(...)` returns `tensor.to(device)`."""
    global _depth, _original_cuda
    with _lock:
        if _depth == 0:
            _original_cuda = torch.Tensor.cuda
            torch.Tensor.cuda = _make_cuda(device)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.Tensor.cuda = _original_cuda
                _original_cuda = None


def cuda_calls_on_device(device_fn):
    """A wrapper factory for the registry: run `fn` with `.cuda()` mapped to `device_fn()`."""
    return within(lambda: tensor_cuda_on(device_fn()))

_TYPE_SUFFIX = {
    torch.float32: "FloatTensor",
    torch.float16: "HalfTensor",
    torch.bfloat16: "BFloat16Tensor",
    torch.float64: "DoubleTensor",
    torch.int64: "LongTensor",
    torch.int32: "IntTensor",
    torch.uint8: "ByteTensor",
    torch.bool: "BoolTensor",
}


def _names_cuda(device) -> bool:
    return names_cuda(device)


class CudaToDevice(TorchFunctionMode):
    """Device arguments and `.type()` mapped per op; `.cuda()` by `tensor_cuda_on` while active."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self._cuda_scopes: list = []

    def __enter__(self):
        scope = tensor_cuda_on(self.device)
        scope.__enter__()
        self._cuda_scopes.append(scope)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._cuda_scopes.pop().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs.get("dtype"):
            tensor = args[0]
            if tensor.device.type == self.device.type and tensor.dtype in _TYPE_SUFFIX:
                return f"torch.cuda.{_TYPE_SUFFIX[tensor.dtype]}"
        if "device" in kwargs and _names_cuda(kwargs["device"]):
            kwargs["device"] = self.device
        if kwargs.get("pin_memory") and for_device(self.device).host_is_device():
            # the host is the device: nothing to pin for, and a CPU-only (or GPU-less) torch
            # refuses it (0.12-0.13 get_batch_on_this_cp_rank pins an index it then moves)
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:
            args = tuple(self.device if _names_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def on_device(device_fn):
    """A wrapper factory for the registry: `wrapper=on_device(lambda: acc.device())`."""
    return within(lambda: CudaToDevice(device_fn()))
