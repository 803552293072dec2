"""The device feature (always on): megatron.core trains on whatever accelerator was chosen.

CPU: the narrow `torch.cuda` shim, the RNG tracker on the device's own state, targeted
patches of the Megatron functions that assume CUDA, gloo for NCCL, a tracking allocator
for memory statistics that also caches freed blocks. NPU: torch_npu's `transfer_to_npu`,
HCCL for NCCL, plus the points it misses. CUDA: only the backend-independent fixes.
"""
from __future__ import annotations

import logging

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import Feature
from npuspeed.features.device import (
    cuda_shim, determinism, dist_backend, distopt_fixes, gloo_collectives, megatron_compat, megatron_fixes, rng,
)
from npuspeed.features.device.apex_guard import guard_apex

log = logging.getLogger("npuspeed")


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


class DeviceFeature(Feature):
    name = "device"
    plan_neutral = True  # device plumbing: no memory or time of its own in the plan
    flags = ("--npuspeed-device",)
    always_on = True

    def add_arguments(self, group) -> None:
        group.add_argument(
            "--npuspeed-device", choices=["auto", "npu", "cuda", "cpu"], default="auto",
            help="Accelerator to run on (overrides NPUSPEED_DEVICE; default: detect).",
        )

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

    def register_patches(self, registry, ctx) -> None:
        accelerator = ctx.accelerator
        # Backend-independent: WrappedTorchNorm's SP refusal, MoE split sizes off-CUDA.
        registry.register(
            "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__",
            wrapper=megatron_fixes.norm_with_sequence_parallel, feature=self.name,
        )
        # moe_utils binds te_general_gemm only when Transformer Engine imports (upstream bug).
        registry.register(
            "megatron.core.transformer.moe.moe_utils.te_general_gemm", None, feature=self.name,
            if_missing=True,
        )
        megatron_compat.register(registry, self.name)  # older releases' own bugs (0.12)
        gloo_collectives.register(registry, self.name)  # MoE's uneven expert-TP gather on gloo
        # DistributedOptimizer with torch's Adam (no apex/TE): checkpoint save/load bugs.
        distopt_fixes.register(registry, self.name, ">=0.16,<0.20")  # upstream bugs unchanged through 0.19
        traits = for_device(accelerator.name)
        if traits.runs_cuda_code():
            return
        registry.register(
            "megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu",
            megatron_fixes.maybe_move_tensor_to_cpu, feature=self.name,
        )
        dist_backend.register(registry, self.name)
        if traits.host_is_device():
            cuda_shim.register(registry, accelerator, self.name)
            rng.register(registry, self.name)
            megatron_fixes.register(registry, accelerator, self.name)

    def path(self, ctx) -> str:
        accelerator = ctx.accelerator
        return {
            "cpu": "cpu: torch.cuda shim + targeted Megatron patches, gloo, device RNG, tracking allocator; "
                   + "block cache: " + accelerator.host_cache() + "; memory limit: "
                   + accelerator.memory_limit(),
            "npu": "npu: torch_npu transfer_to_npu + targeted patches, hccl",
            "cuda": "cuda: native, backend-independent fixes only",
        }[accelerator.name]
