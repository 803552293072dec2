"""Capability answers keyed by a torch device, for code that holds a tensor, not an accelerator.

`for_device(t.device).host_is_device()` instead of `t.device.type == "cpu"`: the device names
are compared here only, so a feature asks what a device can do and a new backend is answered
in one place. The host's device types come from the ops layer's table (ops sit below the
accelerator and ask `_dispatch.on_host` / `on_npu` themselves).
"""
from __future__ import annotations

import functools

import torch

from npuspeed.ops import _dispatch
from npuspeed.ops.triton import _runtime


class DeviceTraits:
    """What tensors on one torch device type can do."""

    def __init__(self, device_type: str):
        self.type = device_type

    def host_is_device(self) -> bool:
        """The tensors live in host memory (a copy to the host saves nothing; CPU kernels take them)."""
        return self.type in _dispatch.HOST_DEVICE_TYPES

    def has_streams(self) -> bool:
        """Work is queued on device streams (events, side streams, async copies), not run in order."""
        return self.type not in _dispatch.HOST_DEVICE_TYPES

    def runs_cuda_code(self) -> bool:
        """Code written for CUDA (Megatron's torch.cuda calls, device="cuda") runs here as written;
        elsewhere it needs npuspeed's device shims (CPU) or torch_npu's transfer_to_npu (NPU)."""
        return self.type == "cuda"

    def maps_cuda_itself(self) -> bool:
        """The vendor library maps CUDA-written code onto the device itself (torch_npu's
        transfer_to_npu), so npuspeed's CPU device shims are not installed."""
        return self.type == "npu"

    def has_vendor_kernels(self) -> bool:
        """The device's vendor library (torch_npu) brings its own fused kernels (npuspeed.ops.npu)."""
        return self.type == "npu"

    def has_sdpa_kernels(self) -> bool:
        """torch's flash / memory-efficient scaled_dot_product_attention kernels serve this device."""
        return self.type == "cuda"

    def has_out_dtype_matmul(self) -> bool:
        """torch's matmul with `out_dtype` (16-bit inputs into an fp32 result in one kernel) runs here."""
        return self.type == "cuda"

    def has_fused_adam(self, decoupled_weight_decay: bool = True) -> bool:
        """torch's fused Adam (`fused=True`: `_fused_adamw_`, or `_fused_adam_` without decoupled
        weight decay) has a kernel for this device: torch's own for CPU (torch >= 2.4) and CUDA, the
        vendor library's where it registers one (torch_npu 2.6 has `_fused_adamw_` only)."""
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        privateuse1 = torch._C._get_privateuse1_backend_name()
        key = {"cpu": "CPU", "cuda": "CUDA", privateuse1: "PrivateUse1"}.get(self.type)
        op = "aten::_fused_adamw_" if decoupled_weight_decay else "aten::_fused_adam_"
        return (key is not None and self.type in _get_fused_kernels_supported_devices()
                and torch._C._dispatch_has_kernel_for_dispatch_key(op, key))

    def triton_available(self) -> bool:
        """Triton can run kernels on tensors of this device (npuspeed.ops.triton._runtime's answer)."""
        return _runtime.runs_on_type(self.type)


def names_cuda(device) -> bool:
    """Whether `device` (a string such as "cuda:0" or a torch.device, as code written for CUDA
    passes it) names a CUDA device: what the CPU device shim redirects."""
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


@functools.lru_cache(maxsize=None)
def _traits(device_type: str) -> DeviceTraits:
    return DeviceTraits(device_type)


def for_device(device) -> DeviceTraits:
    """The traits of `device` (a torch.device, a tensor, or a device string such as "cuda:0"; a
    string is not parsed by torch, which knows "npu" only once torch_npu is imported)."""
    if isinstance(device, torch.Tensor):
        device = device.device
    return _traits(device.split(":")[0] if isinstance(device, str) else device.type)
