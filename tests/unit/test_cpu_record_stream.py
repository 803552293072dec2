"""Tensor.record_stream on the CPU backend (device/cpu_streams.py): a no-op for CPU tensors,
as Megatron's EP-overlap schedule calls it with the shim's streams."""
from __future__ import annotations

import pytest
import torch

from npuspeed.features.device.cpu_streams import record_stream_off_device


def test_cpu_tensor_record_stream_is_a_no_op_and_torch_refuses_it():
    stream = torch.cpu.Stream()
    with pytest.raises((RuntimeError, TypeError)):
        torch.ones(2).record_stream(stream)  # torch's own, on the shim's stream type
    wrapped = record_stream_off_device(torch.Tensor.record_stream)
    assert wrapped(torch.ones(2), stream) is None
