"""`torch` as seen by one Megatron module, with tensor factories mapped off CUDA.

Megatron's schedules create one tensor with `device="cuda"` at the start of every
forward-backward call. Running the whole schedule under the device redirect mode would
put a Python hook on every op of the model; instead the schedules module gets its own
`torch` name: an object forwarding everything to torch, except that factory functions
map a CUDA `device=` to the accelerator's device. Nothing else sees it.
"""
from __future__ import annotations

import functools
import types

import torch

from npuspeed.features.cuda_mapping.redirect import _names_cuda

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
              "as_tensor", "zeros_like", "ones_like", "empty_like", "full_like")


class DeviceMappedTorch(types.ModuleType):
    def __init__(self, device_fn):
        super().__init__("torch", "torch, with CUDA factory devices mapped to the accelerator")
        self._npuspeed_device_fn = device_fn

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name not in _FACTORIES:
            return value
        device_fn = self._npuspeed_device_fn

        @functools.wraps(value)
        def factory(*args, **kwargs):
            if _names_cuda(kwargs.get("device")):
                kwargs["device"] = device_fn()
            return value(*args, **kwargs)

        return factory
