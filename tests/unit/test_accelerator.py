"""The accelerator layer: which backend is chosen, the CPU stand-ins, and the device RNG."""
from __future__ import annotations

import sys

import pytest
import torch

import npuspeed.accelerator as accelerator_module
from npuspeed.accelerator import AcceleratorError, NullEvent, NullStream, get_accelerator, reset_accelerator
from npuspeed.accelerator.cpu import CpuAccelerator
from npuspeed.accelerator.device_rng import DeviceRNG


@pytest.fixture
def fresh(monkeypatch):
    """A forgotten accelerator choice, NPUSPEED_DEVICE unset, no torch_npu; the process's own
    accelerator object comes back afterwards (the device patches hold on to it)."""
    monkeypatch.setattr(accelerator_module, "_ACCELERATOR", accelerator_module._ACCELERATOR)
    monkeypatch.delenv("NPUSPEED_DEVICE", raising=False)
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    reset_accelerator()
    return monkeypatch


def _cuda_really_present() -> bool:
    return accelerator_module._cuda_present()


def test_cpu_by_env(fresh):
    fresh.setenv("NPUSPEED_DEVICE", " CPU ")
    acc = get_accelerator()
    assert isinstance(acc, CpuAccelerator)
    assert acc is get_accelerator()  # cached
    assert (acc.name, acc.dist_backend, acc.device()) == ("cpu", "gloo", torch.device("cpu"))
    reset_accelerator()
    assert get_accelerator() is not acc


def test_unknown_device_names_variable_and_choices(fresh):
    fresh.setenv("NPUSPEED_DEVICE", "tpu")
    with pytest.raises(AcceleratorError) as err:
        get_accelerator()
    message = str(err.value)
    assert "NPUSPEED_DEVICE" in message and "'tpu'" in message
    assert "npu, cuda, cpu" in message


def test_npu_without_torch_npu_says_how_to_install(fresh):
    fresh.setenv("NPUSPEED_DEVICE", "npu")
    with pytest.raises(AcceleratorError) as err:
        get_accelerator()
    assert "pip install npuspeed[npu]" in str(err.value)
    assert "torch_npu" in str(err.value)


@pytest.mark.parametrize("version, refused", [("2.4.0", True), ("2.5.1.post2", True), ("2.6.0", False),
                                              ("2.14.0", False)])
def test_npu_with_a_torch_npu_older_than_the_contract_is_refused(fresh, version, refused):
    """torch_npu 2.4.x's npu_grouped_matmul takes another form (the contract tier found it):
    the oldest release the NPU paths are checked against is 2.6.0."""
    import types

    fresh.setenv("NPUSPEED_DEVICE", "npu")
    fresh.setitem(sys.modules, "torch_npu", types.SimpleNamespace(__version__=version))
    fresh.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0),
                  raising=False)
    with pytest.raises(AcceleratorError) as err:
        get_accelerator()
    message = str(err.value)
    if refused:
        assert f"torch_npu {version}" in message and "torch_npu>=2.6.0" in message and "NPUSPEED_DEVICE" in message
    else:
        assert "sees no NPU device" in message


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch")
def test_cuda_on_cpu_build_is_a_clear_error(npuspeed_runtime, fresh):
    # after the device feature, torch.cuda.is_available is the CPU shim (True): the
    # accelerator must still ask torch's own function
    assert torch.cuda.is_available() is True
    fresh.setenv("NPUSPEED_DEVICE", "cuda")
    with pytest.raises(AcceleratorError, match="NPUSPEED_DEVICE=cuda.*no CUDA device"):
        get_accelerator()


def test_auto_detection_order(npuspeed_runtime, fresh):
    # Here: no NPU, no CUDA -> CPU, even with torch.cuda shimmed by the device feature.
    if not _cuda_really_present():
        assert accelerator_module.select_device_name() == "cpu"
        assert get_accelerator().name == "cpu"
    fresh.setattr(accelerator_module, "_cuda_present", lambda: True)
    assert accelerator_module.select_device_name() == "cuda"
    fresh.setattr(accelerator_module, "_npu_present", lambda: True)
    assert accelerator_module.select_device_name() == "npu"
    fresh.setenv("NPUSPEED_DEVICE", "cpu")  # the variable wins over detection
    assert accelerator_module.select_device_name() == "cpu"


def test_npu_detection_treats_missing_torch_npu_as_absent(fresh):
    assert accelerator_module._npu_present() is False


def test_null_stream_and_event_have_cuda_shape():
    acc = CpuAccelerator()
    stream = acc.Stream()
    assert isinstance(stream, NullStream)
    assert stream.wait_stream(acc.current_stream()) is None
    assert acc.default_stream() is acc.current_stream()
    start = acc.Event(enable_timing=True)
    assert isinstance(start, NullEvent)
    with pytest.raises(RuntimeError, match="recorded"):
        start.elapsed_time(acc.Event(enable_timing=True))
    start.record()
    with acc.stream(stream):
        torch.ones(64, 64) @ torch.ones(64, 64)
    end = stream.record_event()
    assert isinstance(end, NullEvent)
    stream.wait_event(end)
    end.wait(stream)
    end.synchronize()
    stream.synchronize()
    assert end.query() and stream.query()
    elapsed = start.elapsed_time(end)
    assert isinstance(elapsed, float) and elapsed >= 0.0
    mine = NullEvent()
    assert stream.record_event(mine) is mine and mine._time is not None


def test_cpu_describe():
    info = CpuAccelerator().describe()
    assert info["device"] == "cpu" and info["dist_backend"] == "gloo"
    assert info["device_count"] >= 1 and info["mc2"] is False


def _draws(state: torch.Tensor, n: int = 4) -> torch.Tensor:
    gen = torch.Generator()
    gen.set_state(state)
    return torch.rand(n, generator=gen)


def _seeded(seed: int) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


@pytest.fixture
def host_rng():
    saved = torch.get_rng_state()
    yield
    torch.set_rng_state(saved)


def test_device_rng_is_separate_from_host(host_rng):
    rng = DeviceRNG(seed=7)
    device_before = rng.get_state()
    assert torch.equal(device_before, _seeded(7))
    torch.manual_seed(123)
    torch.rand(10)  # host draws
    assert torch.equal(rng.get_state(), device_before)
    host_before = torch.get_rng_state()
    with rng.scope():
        assert rng.active
        inside = torch.rand(4)
    assert not rng.active
    assert torch.equal(inside, _draws(_seeded(7)))
    assert torch.equal(torch.get_rng_state(), host_before)  # the host did not move
    assert not torch.equal(rng.get_state(), device_before)  # the device did
    with rng.scope():
        more = torch.rand(4)
    assert torch.equal(torch.cat([inside, more]), _draws(_seeded(7), 8))


def test_device_rng_nested_scope(host_rng):
    rng = DeviceRNG(seed=3)
    host_before = torch.get_rng_state()
    with rng.scope():
        a = torch.rand(2)
        with rng.scope():
            b = torch.rand(2)
        assert rng.active
        c = torch.rand(2)
    assert torch.equal(torch.cat([a, b, c]), _draws(_seeded(3), 6))
    assert torch.equal(torch.get_rng_state(), host_before)


def test_device_rng_scope_restores_host_on_error(host_rng):
    rng = DeviceRNG(seed=3)
    host_before = torch.get_rng_state()
    with pytest.raises(ValueError):
        with rng.scope():
            torch.rand(3)
            raise ValueError
    assert not rng.active
    assert torch.equal(torch.get_rng_state(), host_before)


def test_device_rng_set_get_parked_and_active(host_rng):
    rng = DeviceRNG()
    host_before = torch.get_rng_state()
    rng.manual_seed(11)  # parked: host untouched
    assert torch.equal(rng.get_state(), _seeded(11))
    assert torch.equal(torch.get_rng_state(), host_before)
    got = rng.get_state()
    got.zero_()  # a copy, not the parked state itself
    assert torch.equal(rng.get_state(), _seeded(11))
    with rng.scope():
        assert torch.equal(rng.get_state(), _seeded(11))
        rng.set_state(_seeded(12))  # active: it is the default generator's state now
        assert torch.equal(torch.get_rng_state(), _seeded(12))
        x = torch.rand(3)
        assert torch.equal(rng.get_state(), torch.get_rng_state())
    assert torch.equal(x, _draws(_seeded(12), 3))
    assert torch.equal(torch.get_rng_state(), host_before)
    with rng.scope():
        assert torch.equal(torch.rand(3), _draws(_seeded(12), 6)[3:])


class _FakeCudaModule:
    """The few `torch.cuda` functions the CUDA backend's memory answers read, with known values
    (the backend takes its module as an argument, so it is testable without a GPU)."""

    def __init__(self):
        self.calls = []

    def memory_allocated(self, device=None):
        return 1000

    def max_memory_allocated(self, device=None):
        return 3000

    def reset_peak_memory_stats(self, device=None):
        self.calls.append("reset_peak_memory_stats")

    def memory_reserved(self, device=None):
        return 4096

    def max_memory_reserved(self, device=None):
        return 8192

    def empty_cache(self):
        self.calls.append("empty_cache")


def _public(cls) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def test_every_backend_answers_what_the_cpu_backend_answers():
    """Code calls the accelerator without asking which backend it is (the device feature sets
    up memory tracking, the bench harness too): a method only the CPU backend has is an
    AttributeError on a GPU (issue 23: `CudaAccelerator` had no `enable_memory_tracking`)."""
    from npuspeed.accelerator.cuda import CudaAccelerator
    from npuspeed.accelerator.npu import NpuAccelerator

    for backend in (CudaAccelerator, NpuAccelerator):
        missing = _public(CpuAccelerator) - _public(backend)
        assert not missing, f"{backend.__name__} lacks {sorted(missing)}"


def test_cuda_backend_memory_setup_is_a_no_op_and_stats_come_from_the_allocator():
    from npuspeed.accelerator.cuda import CudaAccelerator

    module = _FakeCudaModule()
    acc = CudaAccelerator(module=module)
    assert acc.enable_memory_tracking() is True  # the caching allocator always counts
    assert acc.configure_host_cache() == acc.host_cache() == "n/a (the device's own caching allocator)"
    assert acc.configure_memory_limit() == acc.memory_limit() == "n/a (the device's own memory)"
    assert module.calls == []  # setting up changed nothing on the device
    assert (acc.memory_allocated(), acc.max_memory_allocated()) == (1000, 3000)
    assert (acc.memory_reserved(), acc.max_memory_reserved()) == (4096, 8192)
    acc.reset_peak_memory_stats()
    acc.empty_cache()
    assert module.calls == ["reset_peak_memory_stats", "empty_cache"]
    assert acc.memory_tracking() == "device allocator"
