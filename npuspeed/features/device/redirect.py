"""Run a Megatron function written for CUDA on the accelerator's device.

Megatron creates tensors with `device='cuda'`, moves them with `.cuda()` and checks
`param.type() == 'torch.cuda.FloatTensor'`. `on_device(fn)` runs `fn` under a
TorchFunctionMode that maps those onto the accelerator: device arguments naming CUDA
become the accelerator's device, `.cuda()` becomes `.to(device)`, and `.type()` of a
tensor on the accelerator answers with the CUDA type name Megatron expects. The mode is
active only inside the wrapped function, so it is applied to named functions
(optimizer set-up, grad clipping, ...), never to a whole model.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from npuspeed.patching.wrappers import within

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
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToDevice(TorchFunctionMode):
    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0].to(self.device, non_blocking=kwargs.get("non_blocking", False))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs.get("dtype"):
            tensor = args[0]
            if tensor.device.type == self.device.type and tensor.dtype in _TYPE_SUFFIX:
                return f"torch.cuda.{_TYPE_SUFFIX[tensor.dtype]}"
        if "device" in kwargs and _names_cuda(kwargs["device"]):
            kwargs["device"] = self.device
        if func is torch.Tensor.to:
            args = tuple(self.device if _names_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def on_device(device_fn):
    """A wrapper factory for the registry: `wrapper=on_device(lambda: acc.device())`."""
    return within(lambda: CudaToDevice(device_fn()))
