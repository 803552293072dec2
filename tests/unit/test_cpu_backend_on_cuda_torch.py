"""The CPU backend on a CUDA build of torch without a GPU (the default torch wheel on Linux).

The device feature's shim tells Megatron "a device is there"; torch's own code must still hear
the truth, or it goes on to the driver (`torch.accelerator.current_stream()` in every torch.optim
step). Also the CUDA stand-ins that Megatron 0.17-0.19's new code hands around.
"""
from __future__ import annotations

import pytest
import torch

import npuspeed.accelerator as accelerator_module
from npuspeed.accelerator import AcceleratorError, NullStream, get_accelerator, reset_accelerator

cuda_build = pytest.mark.skipif(torch.version.cuda is None,
                                reason="needs a CUDA build of torch (torch.version.cuda is None here)")


@pytest.fixture
def cpu_on_cuda_build(npuspeed_runtime):
    # torch's C++ count, which no Python shim can change
    if torch.version.cuda is not None and torch._C._cuda_getDeviceCount() > 0:
        pytest.skip("a CUDA device is present: this is the no-GPU case")
    if get_accelerator().name != "cpu":
        pytest.skip("the CPU backend is not the one chosen")
    return npuspeed_runtime


@cuda_build
def test_megatron_hears_a_device_and_torch_hears_the_truth(cpu_on_cuda_build):
    assert torch.cuda.is_available() is True  # this module is not torch: the shim's answer
    assert torch.cuda.device_count() >= 1
    assert torch.accelerator.current_accelerator() == torch.device("cuda")  # built for CUDA
    assert torch.accelerator.current_accelerator(check_available=True) is None
    assert torch.accelerator.is_available() is False
    assert torch.accelerator.device_count() == 0


@cuda_build
@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW(p, lr=0.1),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
])
def test_torch_optim_steps_under_the_adaptor(cpu_on_cuda_build, make):
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = make([param])
    for _ in range(2):
        param.grad = torch.full((4,), 0.5)
        optimizer.step()
    assert param.device.type == "cpu" and bool((param.detach() < 1).all())


@cuda_build
def test_detection_picks_cpu_and_cuda_is_refused(cpu_on_cuda_build, monkeypatch):
    monkeypatch.setattr(accelerator_module, "_ACCELERATOR", accelerator_module._ACCELERATOR)
    monkeypatch.delenv("NPUSPEED_DEVICE", raising=False)
    monkeypatch.setattr(accelerator_module, "_npu_present", lambda: False)
    reset_accelerator()
    assert accelerator_module._cuda_present() is False  # the shim never feeds back
    assert accelerator_module.select_device_name() == "cpu"
    monkeypatch.setenv("NPUSPEED_DEVICE", "cuda")
    reset_accelerator()
    with pytest.raises(AcceleratorError, match="NPUSPEED_DEVICE=cuda.*no CUDA device"):
        get_accelerator()


def test_new_megatron_stream_and_event_calls_take_the_stand_ins(cpu_on_cuda_build):
    """0.18+: Stream.priority_range() and Stream(priority=); 0.19: Event(external=True);
    0.17+: tensor.record_stream(current_stream()) in the EP overlap; is_current_stream_capturing()."""
    _, high = torch.cuda.Stream.priority_range()
    stream = torch.cuda.Stream(device="cuda", priority=high)
    assert isinstance(stream, NullStream) and stream.priority == high
    event = torch.cuda.Event(external=True)
    torch.cuda.current_stream().record_event(event)
    event.wait(stream)
    assert torch.cuda.is_current_stream_capturing() is False
    tensor = torch.ones(2)
    assert tensor.record_stream(torch.cuda.current_stream()) is None
    with pytest.raises((NotImplementedError, RuntimeError)):  # torch's own streams still reach torch
        tensor.record_stream(torch.Stream("cpu"))
