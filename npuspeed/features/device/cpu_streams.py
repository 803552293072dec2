"""`Tensor.record_stream` on the CPU backend.

Megatron's EP-overlap schedule (`--overlap-moe-expert-parallel-comm`, 0.19:
pipeline_parallel/utils.py:269) tells the caching allocator that an input is used on its
communication stream before freeing it: `input.record_stream(self.stream)`. With the CPU
shim's streams (torch.cpu.Stream, not a torch.Stream) torch raises "unknown parameter type";
and on the CPU there is nothing to record (one in-order queue, no caching allocator that
could hand the storage out while a stream still uses it). So for CPU tensors it is a no-op;
any other tensor goes to torch's own.
"""
from __future__ import annotations

import functools


def record_stream_off_device(record_stream):
    @functools.wraps(record_stream)
    def wrapped(self, stream):
        if self.device.type == "cpu":
            return None
        return record_stream(self, stream)

    return wrapped


def register(registry, feature: str) -> None:
    registry.register("torch.Tensor.record_stream", wrapper=record_stream_off_device, feature=feature,
                      megatron=None)
