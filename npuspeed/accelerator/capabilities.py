"""Capability questions every backend answers, so features ask what a device can do instead of
comparing its name (tests/unit/test_capabilities_not_names.py keeps that at zero outside
npuspeed/accelerator/). Per-device-type answers come from devices.py; a backend overrides
what it knows better (the NPU backend its vendor kernels)."""
from __future__ import annotations

from npuspeed.accelerator.devices import DeviceTraits, for_device


class Capabilities:
    """Mixed into Accelerator; `name` is the torch device type."""

    name: str = ""

    def traits(self) -> DeviceTraits:
        """The per-device-type answers (devices.py) for this backend's tensors."""
        return for_device(self.name)

    def kernel(self, name: str):
        """The device's native kernel `name` (e.g. "npu_fusion_attention"), or None: only a
        backend with a vendor kernel library has any (the NPU backend overrides this)."""
        return None

    def has_vendor_kernels(self) -> bool:
        """Whether the device brings its own fused-kernel library (npuspeed.ops.npu fronts it),
        as opposed to npuspeed's Triton/C++ kernels or torch's own."""
        return self.traits().has_vendor_kernels()

    def runs_cuda_code(self) -> bool:
        """Whether code written for CUDA runs here as written (no device shim needed)."""
        return self.traits().runs_cuda_code()

    def has_streams(self) -> bool:
        """Whether work runs on device streams (side streams overlap; a CPU runs in order)."""
        return self.traits().has_streams()

    def has_sdpa_kernels(self) -> bool:
        """Whether torch's flash / memory-efficient SDPA kernels serve this device (CUDA)."""
        return self.traits().has_sdpa_kernels()

    def triton_available(self) -> bool:
        """The one Triton answer: Triton runs kernels on this device's tensors (a driver that
        targets it, or the interpreter for host tensors). ops/triton/_runtime.py computes it."""
        return self.traits().triton_available()
