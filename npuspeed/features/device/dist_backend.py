"""Launch code written for GPUs asks for NCCL; give it the accelerator's backend.

Megatron-LM's default `--distributed-backend nccl`, seed launch scripts and direct
`init_process_group('nccl')` calls keep working on NPU (HCCL) and CPU (gloo). The mapping
is logged once.
"""
from __future__ import annotations

import functools
import logging

import torch

from npuspeed.accelerator import get_accelerator

log = logging.getLogger("npuspeed")
_GPU_BACKENDS = ("nccl", "cuda:nccl")
_logged: set = set()


def map_backend(backend):
    """The backend to use instead of `backend` on this accelerator."""
    acc = get_accelerator()
    if backend is None or (isinstance(backend, str) and backend.lower() in _GPU_BACKENDS):
        if acc.dist_backend != "nccl":
            if backend is not None and backend not in _logged:
                _logged.add(backend)
                log.warning(
                    "npuspeed: distributed backend %r requested; using %r on the %s accelerator",
                    backend, acc.dist_backend, acc.name,
                )
            return acc.dist_backend
    return backend


def _map_device_id(kwargs):
    device_id = kwargs.get("device_id")
    if isinstance(device_id, torch.device) and device_id.type != get_accelerator().name:
        kwargs["device_id"] = None if get_accelerator().host_is_device() else get_accelerator().device(device_id.index)


def init_process_group_wrapper(fn):
    @functools.wraps(fn)
    def init_process_group(backend=None, *args, **kwargs):
        _map_device_id(kwargs)
        return fn(map_backend(backend), *args, **kwargs)

    return init_process_group


def new_group_wrapper(fn):
    @functools.wraps(fn)
    def new_group(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = map_backend(kwargs["backend"])
        return fn(*args, **kwargs)

    return new_group


def register(registry, feature: str) -> None:
    registry.register("torch.distributed.init_process_group", wrapper=init_process_group_wrapper,
                      feature=feature, megatron=None)
    registry.register("torch.distributed.new_group", wrapper=new_group_wrapper,
                      feature=feature, megatron=None)
