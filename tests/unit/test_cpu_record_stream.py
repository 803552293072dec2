"""Tensor.record_stream on the CPU backend (device/cuda_shim.py record_stream_wrapper): Megatron
0.19's EP-overlap schedule records inputs on the shim's streams (torch 2.13 refuses them); on the
CPU there is nothing to record, so the wrapper answers for the accelerator's stand-in streams
and hands any other stream to torch."""
from __future__ import annotations

import torch

from npuspeed.accelerator import NullStream
from npuspeed.features.device.cuda_shim import record_stream_wrapper


def test_stand_in_stream_record_is_a_no_op_other_streams_reach_torch():
    calls = []

    def torch_record_stream(tensor, stream):
        calls.append(stream)
        raise RuntimeError("torch: unknown parameter type")

    wrapped = record_stream_wrapper(torch_record_stream)
    stand_in = NullStream(device=torch.device("cpu"))
    assert wrapped(torch.ones(2), stand_in) is None and calls == []
    other = object()
    try:
        wrapped(torch.ones(2), other)
    except RuntimeError:
        pass
    assert calls == [other]
