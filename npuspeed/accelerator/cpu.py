"""The CPU backend: gloo collectives, in-order streams, its own RNG and real memory counts.

Memory statistics come from a tracking CPU allocator (csrc/cpu/memory_tracker.cpp) that
counts live storage bytes, including storages resized in place; process RSS would hide
frees that the C allocator keeps mapped and includes Python's own heap. The same allocator
keeps large freed blocks for reuse, as a device's caching allocator does (reserved = live +
cached), so a storage freed and grown again between steps does not fault its pages in again.
"""
from __future__ import annotations

import contextlib
import os

import torch

from npuspeed.accelerator.base import Accelerator, AcceleratorError, NullEvent, NullStream
from npuspeed.accelerator.device_rng import DeviceRNG


CACHE_ENV = "NPUSPEED_CPU_CACHE_MB"
LIMIT_ENV = "NPUSPEED_CPU_MEMORY_LIMIT_MB"


def _env_mib(name: str, default: str, parse, example: str):
    """A MiB count from the environment; a value that is not one is an error naming the variable."""
    raw = os.environ.get(name, default)
    try:
        return parse(raw)
    except ValueError:
        raise AcceleratorError(f"{name}={raw!r} is not a number of MiB; give e.g. {example}") from None


class CpuAccelerator(Accelerator):
    name = "cpu"
    dist_backend = "gloo"

    def __init__(self):
        self._rng = DeviceRNG()
        self._stream = NullStream(device=torch.device("cpu"))
        self._memory = None

    def device(self, index=None) -> torch.device:
        return torch.device("cpu")

    def current_device(self) -> int:
        return 0

    def set_device(self, index) -> None:
        return None  # one host, one "device"

    def device_count(self) -> int:
        # torchrun's launchers ask how many devices to spread local ranks over.
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def is_available(self) -> bool:
        return True

    def synchronize(self, device=None) -> None:
        return None  # CPU kernels finish before they return

    def device_name(self) -> str:
        import platform

        return platform.processor() or platform.machine() or "cpu"

    def Stream(self, *args, **kwargs):
        return NullStream(*args, **kwargs)

    def Event(self, *args, **kwargs):
        return NullEvent(*args, **kwargs)

    def current_stream(self, device=None):
        return self._stream

    def stream(self, stream):
        return contextlib.nullcontext(stream)

    # RNG: the device's own state, swapped in around device work.
    def get_rng_state(self, device=None) -> torch.Tensor:
        return self._rng.get_state()

    def set_rng_state(self, state, device=None) -> None:
        self._rng.set_state(state)

    def manual_seed(self, seed: int) -> None:
        self._rng.manual_seed(seed)

    def device_rng_scope(self):
        return self._rng.scope()

    # Memory from the tracking allocator.
    def _tracker(self):
        if self._memory is None:
            from npuspeed.ops import memory_tracker

            self._memory = memory_tracker
            memory_tracker.enable()
        return self._memory

    def enable_memory_tracking(self) -> bool:
        return self._tracker().enabled()

    def memory_allocated(self, device=None) -> int:
        return self._tracker().allocated()

    def max_memory_allocated(self, device=None) -> int:
        return self._tracker().peak()

    def reset_peak_memory_stats(self, device=None) -> None:
        self._tracker().reset_peak()

    def memory_tracking(self) -> str:
        return self._tracker().describe()

    def memory_reserved(self, device=None) -> int:
        return self._tracker().reserved()

    def max_memory_reserved(self, device=None) -> int:
        return self._tracker().peak_reserved()

    def empty_cache(self) -> None:
        self._tracker().empty_cache()

    def configure_host_cache(self) -> str:
        """Cache large freed blocks (`NPUSPEED_CPU_CACHE_MB`, default 2048; 0 turns it off)."""
        mib = _env_mib(CACHE_ENV, "2048", int, "2048, or 0 to turn the CPU block cache off")
        tracker = self._tracker()
        if not tracker.enabled():
            self._host_cache = f"off: {tracker.describe()}"
        else:
            tracker.set_cache_limit(max(mib, 0) << 20)
            self._host_cache = (f"freed blocks >= 1 MiB kept for reuse, up to {mib} MiB ({CACHE_ENV})" if mib > 0
                                else f"off ({CACHE_ENV}=0)")
        return self._host_cache

    def configure_memory_limit(self) -> str:
        """Refuse allocations above `NPUSPEED_CPU_MEMORY_LIMIT_MB` of live tensors (unset or 0:
        no limit) with torch.OutOfMemoryError, as a device with that much memory would."""
        mib = _env_mib(LIMIT_ENV, "0", float, "512, or 0 for no limit")
        tracker = self._tracker()
        if mib <= 0:
            tracker.set_limit(0)
            self._memory_limit = "none"
        elif not tracker.set_limit(int(mib * 2**20)):
            raise AcceleratorError(f"{LIMIT_ENV}={mib:g}: the tracking allocator cannot enforce a limit "
                                   f"here ({tracker.describe()}); rebuild npuspeed's op library or unset it")
        else:
            self._memory_limit = f"{mib:g} MiB of live tensors ({LIMIT_ENV})"
        return self._memory_limit

    def memory_limit(self) -> str:
        return getattr(self, "_memory_limit", "none")

    def host_cache(self) -> str:
        return getattr(self, "_host_cache", "off: not configured")

    def is_bf16_supported(self) -> bool:
        return True

    # Host memory: the CPU's tensors are host memory already; copies stay synchronous.
    def host_is_device(self) -> bool:
        return True

    def has_pinned_memory(self) -> bool:
        return False  # nothing to page-lock for: no device link to copy over

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        return None  # one in-order stream: nothing to tell

    def has_fused_attention(self) -> bool:
        # scaled_dot_product_attention has a flash kernel on CPU.
        return True
