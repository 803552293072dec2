"""The narrow `torch.cuda` shim for the CPU backend.

Megatron (and launch scripts written for GPUs) call a known set of `torch.cuda` names:
`current_device()` as a device argument, `set_device`, RNG state, streams, memory
statistics, `synchronize`. On a CPU build these raise or, worse, silently queue work
(`manual_seed` goes through `_lazy_call`). Each name below is answered by the accelerator.
Every shim is its own function object: aliasing a `torch.cpu` function breaks dynamo,
which registers one handler per function object. On CUDA nothing here is installed; on
NPU torch_npu's transfer_to_npu does the same job.

The questions that gate real CUDA work (`is_available`, `is_initialized`, `device_count`)
get two answers: Megatron and launch scripts hear the accelerator's ("a device is there"),
torch's own modules hear torch's. On a CUDA build of torch without a GPU, torch's code
that sees "available" goes on to the driver (`torch.accelerator.current_stream()` in every
`torch.optim` step, `torch.accelerator.is_available()`, pinned memory): it must see the truth.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch

from npuspeed.accelerator.base import Accelerator, NullStream

# name -> builder(accelerator) returning the shim. Only names Megatron or launchers use.
_SHIMS: dict[str, Callable[[Accelerator], Callable]] = {
    # current_device() feeds `device=` arguments, so it answers with a torch.device.
    "current_device": lambda a: (lambda: a.device()),
    "set_device": lambda a: (lambda device: a.set_device(device)),
    "device_count": lambda a: (lambda: a.device_count()),
    "is_available": lambda a: (lambda: a.is_available()),
    "is_initialized": lambda a: (lambda: True),
    "synchronize": lambda a: (lambda device=None: a.synchronize(device)),
    "get_rng_state": lambda a: (lambda device="cuda": a.get_rng_state()),
    "set_rng_state": lambda a: (lambda new_state, device="cuda": a.set_rng_state(new_state)),
    "manual_seed": lambda a: (lambda seed: a.manual_seed(seed)),
    "manual_seed_all": lambda a: (lambda seed: a.manual_seed_all(seed)),
    "memory_allocated": lambda a: (lambda device=None: a.memory_allocated(device)),
    "max_memory_allocated": lambda a: (lambda device=None: a.max_memory_allocated(device)),
    "memory_reserved": lambda a: (lambda device=None: a.memory_reserved(device)),
    "max_memory_reserved": lambda a: (lambda device=None: a.max_memory_reserved(device)),
    "reset_peak_memory_stats": lambda a: (lambda device=None: a.reset_peak_memory_stats(device)),
    "reset_max_memory_allocated": lambda a: (lambda device=None: a.reset_peak_memory_stats(device)),
    "memory_stats": lambda a: (lambda device=None: a.memory_stats(device)),
    "empty_cache": lambda a: (lambda: a.empty_cache()),
    "get_device_name": lambda a: (lambda device=None: a.device_name()),
    # There is no CUDA device: answer as a CPU build of torch does (RuntimeError, which
    # inductor catches); torch's own would raise ValueError past the shim's is_initialized.
    "get_device_properties": lambda a: _no_device_properties,
    # Classes, so isinstance checks keep working.
    "Stream": lambda a: type("Stream", (type(a.Stream()),), {}),
    "Event": lambda a: type("Event", (type(a.Event()),), {}),
    "current_stream": lambda a: (lambda device=None: a.current_stream(device)),
    "default_stream": lambda a: (lambda device=None: a.default_stream(device)),
    "stream": lambda a: (lambda stream: a.stream(stream)),
    # Nothing is ever captured into a graph here (Megatron 0.19's MoE dispatch and router ask).
    "is_current_stream_capturing": lambda a: (lambda: False),
    "nvtx.range_push": lambda a: (lambda msg: 0),
    "nvtx.range_pop": lambda a: (lambda: 0),
}


# Shims whose callers inside torch get torch's own answer (see the module docstring).
TRUTHFUL_TO_TORCH = ("is_available", "is_initialized", "device_count")


def _called_from_torch(depth: int = 2) -> bool:
    name = sys._getframe(depth).f_globals.get("__name__", "")
    return name == "torch" or name.startswith("torch.")


def torch_original(fn):
    """torch's own function behind a shim (the function itself when it is not one)."""
    return getattr(fn, "_npuspeed_torch_original", fn)


def _two_faced(name: str, shim: Callable) -> Callable:
    original = torch_original(getattr(torch.cuda, name))

    def answer(*args, **kwargs):
        if _called_from_torch():
            return original(*args, **kwargs)
        return shim(*args, **kwargs)

    answer._npuspeed_torch_original = original
    return answer


def _no_device_properties(device=None):
    raise RuntimeError("torch.cuda.get_device_properties: no CUDA device (npuspeed runs on the CPU)")


def shim_names() -> list[str]:
    return list(_SHIMS)


def record_stream_wrapper(record_stream):
    """`tensor.record_stream(<the current CUDA stream>)` (Megatron 0.17+'s EP overlap) hands
    torch the accelerator's stand-in stream, which only names in-order work: nothing to record.
    Any other stream goes to torch as before."""

    def record(self, stream):
        if isinstance(stream, NullStream):
            return None
        return record_stream(self, stream)

    record.__qualname__ = "npuspeed_record_stream"
    return record


def register(registry, accelerator: Accelerator, feature: str) -> None:
    registry.register("torch.Tensor.record_stream", wrapper=record_stream_wrapper, feature=feature,
                      megatron=None)
    for name, build in _SHIMS.items():
        shim = build(accelerator)
        if name in TRUTHFUL_TO_TORCH:
            shim = _two_faced(name, shim)
        if not isinstance(shim, type):
            shim.__name__ = name.rsplit(".", 1)[-1]
            shim.__qualname__ = f"npuspeed_cuda_shim.{name}"
        shim.__doc__ = f"torch.cuda.{name} answered by the {accelerator.name} accelerator"
        registry.register(f"torch.cuda.{name}", shim, feature=feature, megatron=None)
