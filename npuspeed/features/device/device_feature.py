"""The device feature (always on): megatron.core trains on whatever accelerator was chosen.

CPU: the narrow `torch.cuda` shim, the RNG tracker on the device's own state, targeted
patches of the Megatron functions that assume CUDA, gloo for NCCL, a tracking allocator
for memory statistics that also caches freed blocks. NPU: torch_npu's `transfer_to_npu`,
HCCL for NCCL, plus the points it misses. CUDA: only the backend-independent fixes. Which
patch applies where: patches.py.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import Feature
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.device import patches as _patches
from npuspeed.features.device import determinism
from npuspeed.features.device.apex_guard import guard_apex

log = logging.getLogger("npuspeed")


@dataclass(frozen=True)
class Config(FeatureConfig):
    npuspeed_device: str = flag("--npuspeed-device", "auto", choices=["auto", "npu", "cuda", "cpu"])
    """Accelerator to run on (overrides NPUSPEED_DEVICE; default: detect)."""
    npuspeed_adam: str = flag("--npuspeed-adam", "auto", choices=["auto", "megatron"])
    """Where megatron-core falls back to torch's Adam (no Transformer Engine, no apex): auto builds it
    with fused=True where the device has torch's fused kernel (CPU, CUDA, NPU with torch_npu's);
    megatron leaves Megatron's optimizer as it builds it (for-loop on CPU, foreach on a device)."""


def _cache_triton_probe() -> None:
    """torch.compile (Megatron's jit_fuser, e.g. in the MoE router) asks torch's cached probes
    (`torch.utils._triton.has_triton()`, `has_triton_tma_device()`, ...) whether triton can
    target a device. With triton installed they call torch.cuda.get_device_properties once
    torch.cuda says a device is available, which the CPU shim does, and dynamo does not catch
    the shim's "no device" answer. Ask every such probe now, before the shim, so each caches
    torch's own answer."""
    try:
        from torch.utils import _triton
    except ImportError:  # older torch: no such probes
        return
    for name in dir(_triton):
        probe = getattr(_triton, name)
        if name.startswith("has_") and hasattr(probe, "cache_info"):
            try:
                probe()
            except Exception:  # a probe that fails now fails alike later; nothing to cache
                pass


class DeviceFeature(Feature, name="device", Config=Config, patches=_patches,
                    # no plan effect: its patches let megatron.core run on the chosen accelerator without
                    # changing what it computes or keeps; the planner models the device itself
                    plan=None, always_on=True):
    def prepare(self, ctx) -> None:
        """Side effects that must precede patching: the apex guard, NPU's own remapping,
        CPU memory tracking (only storages allocated after this are counted) and its block cache."""
        accelerator = ctx.accelerator
        warning = guard_apex()  # logs it
        if warning and warning not in ctx.notes:
            ctx.notes.append(warning)
        determinism.apply(ctx)
        traits = for_device(accelerator.name)
        if traits.maps_cuda_itself():
            accelerator.transfer_to_npu()
        if traits.host_is_device():
            _cache_triton_probe()
        # every backend answers these (no-ops where the device allocator counts by itself)
        accelerator.enable_memory_tracking()
        accelerator.configure_host_cache()
        accelerator.configure_memory_limit()

    def running(self, ctx) -> str:
        from npuspeed.features.device import fused_adam

        accelerator = ctx.accelerator
        adam = fused_adam.plan_line(self.config(ctx.args).npuspeed_adam, device_type=accelerator.device().type)
        return {
            "cpu": "cpu: torch.cuda shim + targeted Megatron patches, gloo, device RNG, tracking allocator; "
                   + "block cache: " + accelerator.host_cache() + "; memory limit: "
                   + accelerator.memory_limit(),
            "npu": "npu: torch_npu transfer_to_npu + targeted patches, hccl",
            "cuda": "cuda: native, backend-independent fixes only",
        }[accelerator.name] + "; Adam: " + adam
