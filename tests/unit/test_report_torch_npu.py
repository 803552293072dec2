"""`npuspeed report`'s torch_npu section: the release and, per op npuspeed calls, whether it is there.

An NPU is faked (a CPU accelerator named 'npu' carrying a module as its torch_npu); the list of
ops is checked against npuspeed's source, so a new torch_npu call without a report line fails.
"""
from __future__ import annotations

import json
import pathlib
import types

import pytest

from npu_contract import callsites
from npuspeed.accelerator import npu_ops

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "npuspeed"
PRESENT = (npu_ops.FUSION_ATTENTION, npu_ops.RMS_NORM, npu_ops.GROUPED_MATMUL, npu_ops.MATMUL_ADD_FP32)


class _FakeNpu:
    """The CPU accelerator, named 'npu', with a stand-in torch_npu and its own matmul-add answer."""

    name = "npu"

    def __init__(self, cpu, torch_npu, matmul_add: bool):
        self._cpu, self.torch_npu, self._matmul_add = cpu, torch_npu, matmul_add

    def has_matmul_add_fp32(self) -> bool:
        return self._matmul_add

    def __getattr__(self, item):
        return getattr(self._cpu, item)


def _torch_npu(ops=PRESENT, version="2.9.0.post1"):
    module = types.ModuleType("torch_npu")
    module.__version__ = version
    for op in ops:
        setattr(module, op, lambda *a, **k: None)
    return module


def _report(monkeypatch, capsys, runtime, acc, *flags) -> dict:
    from npuspeed import cli

    monkeypatch.setattr(runtime, "accelerator", acc)
    assert cli.main(["report", *flags]) == 0
    out = capsys.readouterr().out
    return json.loads(out) if "--json" in flags else out


@pytest.mark.parametrize("matmul_add", [False, True])
def test_json_names_release_and_each_op(npuspeed_runtime, monkeypatch, capsys, matmul_add):
    acc = _FakeNpu(npuspeed_runtime.accelerator, _torch_npu(), matmul_add)
    data = _report(monkeypatch, capsys, npuspeed_runtime, acc, "--json")["torch_npu"]
    assert data["version"] == "2.9.0.post1"
    assert set(data["ops"]) == set(npu_ops.USED_BY)
    for op, row in data["ops"].items():
        # the lazy _npu_matmul_add_fp32 wrapper is there either way: the accelerator's answer counts
        want = matmul_add if op == npu_ops.MATMUL_ADD_FP32 else op in PRESENT
        assert row == {"found": want, "used_by": npu_ops.USED_BY[op]}, op
    assert data["ops"][npu_ops.MOE_PERMUTE]["used_by"] == "--use-fused-moe-token-permute-and-unpermute"


def test_text_lists_missing_ops(npuspeed_runtime, monkeypatch, capsys):
    acc = _FakeNpu(npuspeed_runtime.accelerator, _torch_npu(), False)
    text = _report(monkeypatch, capsys, npuspeed_runtime, acc)
    assert f"torch_npu 2.9.0.post1: 3 of {len(npu_ops.USED_BY)} ops npuspeed calls" in text
    rows = {line.split()[0]: line.split()[1] for line in text.splitlines() if line.startswith(("npu_", "_npu_"))}
    assert rows[npu_ops.FUSION_ATTENTION] == "yes" and rows[npu_ops.SWIGLU] == "NO"
    assert rows[npu_ops.MATMUL_ADD_FP32] == "NO"


def test_off_npu_the_key_is_null(npuspeed_runtime, capsys):
    from npuspeed import cli

    assert npuspeed_runtime.accelerator.name == "cpu"
    assert cli.main(["report", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "torch_npu" in data and data["torch_npu"] is None
    assert cli.main(["report"]) == 0
    assert "torch_npu: not used (no NPU: the device is cpu)" in capsys.readouterr().out


def _called_ops() -> dict[str, str]:
    """Every `<x>.npu_*(...)` / `<x>._npu_*(...)` call in npuspeed's source: op -> first file:line."""
    found = {}
    for site in callsites.source_sites(None):
        found.setdefault(site.op, site.where)
    return found


def test_the_list_covers_every_torch_npu_call():
    called = _called_ops()
    assert npu_ops.FUSION_ATTENTION in called and npu_ops.MM_ALL_REDUCE in called  # the walk sees calls
    missing = {op: where for op, where in called.items() if op not in npu_ops.USED_BY}
    assert not missing, f"torch_npu ops called but not in npuspeed/accelerator/npu_ops.py: {missing}"


def test_each_listed_op_is_still_named_in_the_source():
    text = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "npu_ops.py")
    stale = [op for op in npu_ops.USED_BY if op not in text]
    assert not stale, f"listed in npu_ops.py but named nowhere else in npuspeed: {stale}"
