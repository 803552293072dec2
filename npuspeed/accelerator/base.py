"""The one interface every backend answers.

Megatron code asks device questions in many places; npuspeed asks them only here, so a
new backend is one small class and the rest of the package never names `torch.cuda` or
`torch_npu` (a unit test greps for that).
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import torch

from npuspeed.accelerator.capabilities import Capabilities
from npuspeed.accelerator.errors import AcceleratorError  # noqa: F401  (re-exported: its home before)


class NullStream:
    """A stream of the same shape as `torch.cuda.Stream` for backends that run in order."""

    def __init__(self, device=None, priority: int = 0, **_kwargs):
        self.device = device
        self.priority = priority

    @staticmethod
    def priority_range() -> tuple[int, int]:
        """(lowest, highest) as `torch.cuda.Stream.priority_range()` answers (Megatron 0.18+
        asks it for its EP-overlap streams); in-order work has one priority."""
        return (0, 0)

    def wait_stream(self, stream) -> None:  # work is already ordered
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None):
        event = event or NullEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class NullEvent:
    """An event of the same shape as `torch.cuda.Event`; elapsed time comes from the host clock."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 external: bool = False):
        # `external` (Megatron 0.19's activation offload, CUDA graphs): an event recorded
        # inside a captured graph; without graphs it is an ordinary event.
        self.enable_timing = enable_timing
        self._time = None

    def record(self, stream=None) -> None:
        import time

        self._time = time.perf_counter()

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: "NullEvent") -> float:
        if self._time is None or end._time is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end._time - self._time) * 1000.0


class Accelerator(Capabilities, ABC):
    """Device questions, answered for one backend.

    `name` is the torch device type ("cpu", "cuda", "npu"); `dist_backend` the collective
    library that goes with it. Features ask capabilities (capabilities.py), never the name.
    """

    name: str = ""
    dist_backend: str = ""

    # -- device -------------------------------------------------------------------------------
    def device(self, index: int | None = None) -> torch.device:
        if index is None:
            index = self.current_device()
        return torch.device(self.name, index)

    @abstractmethod
    def current_device(self) -> int: ...

    @abstractmethod
    def set_device(self, index: int) -> None: ...

    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def is_available(self) -> bool: ...

    @abstractmethod
    def synchronize(self, device=None) -> None: ...

    def device_name(self) -> str:
        return self.name

    # -- streams and events -------------------------------------------------------------------
    @abstractmethod
    def Stream(self, *args, **kwargs): ...

    @abstractmethod
    def Event(self, *args, **kwargs): ...

    @abstractmethod
    def current_stream(self, device=None): ...

    def default_stream(self, device=None):
        return self.current_stream(device)

    @abstractmethod
    def stream(self, stream) -> contextlib.AbstractContextManager: ...

    # -- random numbers -----------------------------------------------------------------------
    @abstractmethod
    def get_rng_state(self, device=None) -> torch.Tensor: ...

    @abstractmethod
    def set_rng_state(self, state: torch.Tensor, device=None) -> None: ...

    @abstractmethod
    def manual_seed(self, seed: int) -> None: ...

    def manual_seed_all(self, seed: int) -> None:
        self.manual_seed(seed)

    def device_rng_scope(self) -> contextlib.AbstractContextManager:
        """Where device kernels draw random numbers. Real devices need nothing."""
        return contextlib.nullcontext()

    # -- memory -------------------------------------------------------------------------------
    @abstractmethod
    def memory_allocated(self, device=None) -> int: ...

    @abstractmethod
    def max_memory_allocated(self, device=None) -> int: ...

    @abstractmethod
    def reset_peak_memory_stats(self, device=None) -> None: ...

    def memory_reserved(self, device=None) -> int:
        return self.memory_allocated(device)

    def max_memory_reserved(self, device=None) -> int:
        return self.max_memory_allocated(device)

    def empty_cache(self) -> None:
        return None

    def memory_stats(self, device=None) -> dict:
        return {
            "allocated_bytes.all.current": self.memory_allocated(device),
            "allocated_bytes.all.peak": self.max_memory_allocated(device),
            "reserved_bytes.all.current": self.memory_reserved(device),
            "reserved_bytes.all.peak": self.max_memory_reserved(device),
        }

    def enable_memory_tracking(self) -> bool:
        """Start counting memory from here on; True when the counts are real. A device's caching
        allocator always counts, so only the CPU backend has something to switch on."""
        return True

    def configure_host_cache(self) -> str:
        """Set up the CPU block cache from the environment (CPU only); returns `host_cache()`."""
        return self.host_cache()

    def configure_memory_limit(self) -> str:
        """Set up a live-memory limit from the environment (CPU only); returns `memory_limit()`."""
        return self.memory_limit()

    def memory_tracking(self) -> str:
        """How the memory numbers are obtained, for `npuspeed report`."""
        return "device allocator"

    def host_cache(self) -> str:
        """The CPU tensor block cache, for `npuspeed report` (only the CPU backend has one)."""
        return "n/a (the device's own caching allocator)"

    def memory_limit(self) -> str:
        """A limit on live tensor bytes this process enforces (only the CPU backend has one)."""
        return "n/a (the device's own memory)"

    # -- host memory (activation swap) --------------------------------------------------------
    def host_is_device(self) -> bool:
        """True where device tensors already live in host memory (CPU): a swap saves nothing."""
        return False

    def has_pinned_memory(self) -> bool:
        """Whether page-locked host buffers can be made (what async device-host copies need)."""
        return False

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """A page-locked host byte buffer of `nbytes` (for copies overlapped with compute)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def host_link_bytes_per_s(self) -> float:
        """Bytes per second of a host<->device copy (npuspeed/accelerator/host_link.py)."""
        from npuspeed.accelerator.host_link import host_link_bytes_per_s

        return host_link_bytes_per_s(self.name)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Tell the caching allocator `tensor` is in use on `stream` (a side-stream copy)."""
        tensor.record_stream(stream)

    # -- capabilities -------------------------------------------------------------------------
    def has_fused_attention(self) -> bool:
        return False

    def has_mc2(self) -> bool:
        return False

    def is_bf16_supported(self) -> bool:
        return True

    def has_matmul_add_fp32(self) -> bool:
        """Whether the device has one kernel for `main_grad += dY^T X` with 16-bit dY, X and an
        fp32 main_grad (gradient-accumulation fusion)."""
        return False

    def matmul_add_fp32(self, grad_output, total_input, main_grad) -> None:
        """`main_grad += grad_output^T @ total_input` in the device's fused kernel."""
        raise NotImplementedError(f"{self.name}: no fused matmul-add kernel")

    def describe(self) -> dict:
        """A summary for `npuspeed report`."""
        return {
            "device": self.name,
            "device_name": self.device_name(),
            "device_count": self.device_count(),
            "dist_backend": self.dist_backend,
            "bf16": self.is_bf16_supported(),
            "fused_attention": self.has_fused_attention(),
            "mc2": self.has_mc2(),
            "memory_tracking": self.memory_tracking(),
            "host_cache": self.host_cache(),
            "memory_limit": self.memory_limit(),
        }
