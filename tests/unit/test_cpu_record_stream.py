"""Tensor.record_stream on the CPU backend (device/cuda_shim.py record_stream_wrapper): Megatron
0.19's EP-overlap schedule records inputs on the shim's streams, which torch refuses; on the CPU
there is nothing to record, so the wrapper answers for the accelerator's stand-in streams."""
from __future__ import annotations

import pytest
import torch

from npuspeed.accelerator import NullStream
from npuspeed.features.device.cuda_shim import record_stream_wrapper


def test_stand_in_stream_record_is_a_no_op_and_torch_refuses_it():
    stream = NullStream(device=torch.device("cpu"))
    with pytest.raises((RuntimeError, TypeError)):
        torch.ones(2).record_stream(stream)  # torch's own, on the shim's stream type
    wrapped = record_stream_wrapper(torch.Tensor.record_stream)
    assert wrapped(torch.ones(2), stream) is None
