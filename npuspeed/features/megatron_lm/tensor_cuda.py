"""`Tensor.cuda()` calls of megatron.training, made on the accelerator's device.

megatron.training moves data and models with `.cuda()`: `get_batch_on_this_tp_rank`
(every step), `get_model` (`model_module.cuda(...)`), `evaluate` (its loss buffers). On a
CPU build of torch `Tensor.cuda` raises. Running those functions under the device
feature's TorchFunctionMode would also work, but `evaluate` runs the whole model, and a
mode puts a Python hook on every op (and in front of torch.compile'd fusions). So here,
for the duration of the wrapped call only, `torch.Tensor.cuda` itself answers with
`.to(accelerator device)`; `nn.Module.cuda` goes through it too. Re-entrant; restored on
exit, also on an exception.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from npuspeed.patching.wrappers import within

_lock = threading.Lock()
_depth = 0
_original = None


def _make_cuda(device):
    def cuda(self, device_arg=None, non_blocking=False, memory_format=torch.preserve_format, **_kw):
        return self.to(device, non_blocking=non_blocking, memory_format=memory_format)

    cuda.__qualname__ = "npuspeed_tensor_cuda_to_device"
    return cuda


@contextlib.contextmanager
def tensor_cuda_on(device):
    """Within the block, `tensor.cuda(...)` returns `tensor.to(device)`."""
    global _depth, _original
    with _lock:
        if _depth == 0:
            _original = torch.Tensor.cuda
            torch.Tensor.cuda = _make_cuda(device)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.Tensor.cuda = _original
                _original = None


def cuda_calls_on_device(device_fn):
    """A wrapper factory for the registry: run `fn` with `.cuda()` mapped to `device_fn()`."""
    return within(lambda: tensor_cuda_on(device_fn()))
