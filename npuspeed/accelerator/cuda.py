"""The CUDA backend: a thin face over `torch.cuda` and NCCL."""
from __future__ import annotations

import torch

from npuspeed.accelerator.base import Accelerator


class CudaAccelerator(Accelerator):
    name = "cuda"
    dist_backend = "nccl"

    def __init__(self, module=None):
        # `module` lets the NPU backend reuse this class over `torch.npu`, which mirrors it.
        self._m = module if module is not None else torch.cuda

    def current_device(self) -> int:
        return self._m.current_device()

    def set_device(self, index) -> None:
        self._m.set_device(index)

    def device_count(self) -> int:
        return self._m.device_count()

    def is_available(self) -> bool:
        return self._m.is_available()

    def synchronize(self, device=None) -> None:
        self._m.synchronize(device)

    def device_name(self) -> str:
        return self._m.get_device_name(self.current_device())

    def has_pinned_memory(self) -> bool:
        # torch's pinned host allocator serves CUDA, and torch_npu registers one for the NPU
        return self.is_available()

    def Stream(self, *args, **kwargs):
        return self._m.Stream(*args, **kwargs)

    def Event(self, *args, **kwargs):
        return self._m.Event(*args, **kwargs)

    def current_stream(self, device=None):
        return self._m.current_stream(device)

    def default_stream(self, device=None):
        return self._m.default_stream(device)

    def stream(self, stream):
        return self._m.stream(stream)

    def get_rng_state(self, device=None):
        return self._m.get_rng_state(device if device is not None else self.name)

    def set_rng_state(self, state, device=None) -> None:
        self._m.set_rng_state(state, device if device is not None else self.name)

    def manual_seed(self, seed: int) -> None:
        self._m.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self._m.manual_seed_all(seed)

    def memory_allocated(self, device=None) -> int:
        return self._m.memory_allocated(device)

    def max_memory_allocated(self, device=None) -> int:
        return self._m.max_memory_allocated(device)

    def reset_peak_memory_stats(self, device=None) -> None:
        self._m.reset_peak_memory_stats(device)

    def memory_reserved(self, device=None) -> int:
        return self._m.memory_reserved(device)

    def max_memory_reserved(self, device=None) -> int:
        return self._m.max_memory_reserved(device)

    def empty_cache(self) -> None:
        self._m.empty_cache()

    def memory_stats(self, device=None) -> dict:
        return dict(self._m.memory_stats(device))

    def is_bf16_supported(self) -> bool:
        return bool(self._m.is_bf16_supported())

    def has_fused_attention(self) -> bool:
        return True  # scaled_dot_product_attention's flash / memory-efficient kernels
