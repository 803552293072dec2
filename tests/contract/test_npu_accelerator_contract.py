"""The NPU accelerator against each release's `torch.npu` as the wheel defines it: every name
npuspeed reaches exists there, and the accelerator's whole face runs on the stand-in."""
from __future__ import annotations

import ast
import re

import pytest
import torch

from npu_contract import callsites, npu_module, on_host, standin, wheel

CUDA_FACE = callsites.PACKAGE / "accelerator" / "cuda.py"


def _module_attributes() -> set[str]:
    """`self._m.X` in the CUDA face (run over torch.npu on an NPU) and `torch.npu.X` anywhere."""
    names = {node.attr for node in ast.walk(ast.parse(CUDA_FACE.read_text()))
             if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
             and node.value.attr == "_m"}
    for path in callsites.PACKAGE.rglob("*.py"):
        names |= set(re.findall(r"\btorch\.npu\.([A-Za-z_]\w*)", path.read_text()))
    return names


@pytest.mark.parametrize("release", wheel.RELEASES)
def test_every_torch_npu_name_npuspeed_reaches_exists_in_the_release(release):
    names = _module_attributes()
    assert {"Stream", "Event", "memory_allocated", "get_rng_state"} <= names
    assert sorted(names - set(npu_module.exported(release))) == []
    assert (wheel.files(release) / "torch_npu/contrib/transfer_to_npu.py").exists()
    assert 'import_module("torch_npu.contrib.transfer_to_npu")' in (
        callsites.PACKAGE / "accelerator" / "npu.py").read_text()


@pytest.fixture
def npu_accelerator(monkeypatch, request):
    release = request.param
    return release, on_host.npu_accelerator(release, monkeypatch)


@pytest.mark.parametrize("npu_accelerator", wheel.RELEASES, indirect=True)
def test_the_npu_accelerator_face_runs_on_the_release(npu_accelerator):
    release, acc = npu_accelerator
    assert acc.device_count() == 1 and acc.is_available() and acc.is_bf16_supported()
    side = acc.Stream()
    side.wait_stream(acc.current_stream())
    with acc.stream(side):
        event = acc.Event()
        event.record()
    event.wait()
    acc.current_stream().wait_event(event)
    acc.synchronize()
    state = acc.get_rng_state()
    first = torch.rand(3)
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    acc.manual_seed(0)
    acc.reset_peak_memory_stats()
    assert acc.memory_allocated() == 0 and acc.max_memory_allocated() == 0
    assert isinstance(acc.memory_stats(), dict)
    assert acc.has_fused_attention()
    assert acc.has_mc2()
    with pytest.raises(TypeError, match="unexpected keyword"):
        acc.Stream(bogus=1)  # the wheel's constructor keywords bind


@pytest.mark.parametrize("npu_accelerator", wheel.RELEASES, indirect=True)
def test_the_report_names_what_the_release_has(npu_accelerator):
    from npuspeed.accelerator import npu_ops

    release, acc = npu_accelerator
    found = npu_ops.availability(acc)
    assert found["version"] == release
    schemas = standin.contract(release)[0]
    assert {op: v["found"] for op, v in found["ops"].items()} == {op: op in schemas for op in npu_ops.USED_BY}
