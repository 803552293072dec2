"""CPU tensors playing NPU tensors: npuspeed's NPU branches, and its NPU accelerator, run on the
host over a release's stand-ins (torch_npu from standin.py, torch.npu from npu_module.py)."""
from __future__ import annotations

import contextlib
import sys

import torch

from npu_contract import npu_module
from npu_contract.standin import module


@contextlib.contextmanager
def npu_tensors(torch_npu_module):
    """npuspeed's NPU branches taken for CPU tensors, with `torch_npu_module` as torch_npu."""
    from npuspeed.ops import _dispatch

    saved = sys.modules.get("torch_npu"), list(_dispatch.NPU_DEVICE_TYPES)
    sys.modules["torch_npu"] = torch_npu_module
    _dispatch.NPU_DEVICE_TYPES[:] = ["npu", "cpu"]
    try:
        yield
    finally:
        _dispatch.NPU_DEVICE_TYPES[:] = saved[1]
        if saved[0] is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = saved[0]


def npu_accelerator(version: str, monkeypatch, *, nnal: bool = True):
    """npuspeed's NPU accelerator over this release's stand-ins (torch_npu and torch.npu), its
    device the host's: CPU tensors play NPU tensors here too."""
    from npuspeed.accelerator.npu import NpuAccelerator

    monkeypatch.setattr(torch, "npu", npu_module.module(version), raising=False)
    monkeypatch.setitem(sys.modules, "torch_npu", module(version, nnal=nnal))
    monkeypatch.setattr(NpuAccelerator, "device", lambda self, index=None: torch.device("cpu"))
    # page-locked memory needs a device runtime: plain host memory plays it
    monkeypatch.setattr(NpuAccelerator, "pinned_empty", lambda self, n: torch.empty(n, dtype=torch.uint8))
    recorded = []

    def record_stream(tensor, stream):
        """Tensor.record_stream on an NPU takes torch_npu's streams: here only the stand-in's."""
        if type(stream).__name__ != "Stream" or type(stream).__module__ != npu_module.__name__:
            raise TypeError(f"record_stream got {type(stream)!r}, not torch.npu.Stream")
        recorded.append((stream, tensor.untyped_storage().nbytes()))

    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    acc = NpuAccelerator()
    acc.recorded_streams = recorded
    return acc
