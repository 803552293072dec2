"""Features ask the accelerator what a device can do; they never compare device names.

Reads npuspeed/**/*.py with `ast`: outside npuspeed/accelerator/ no comparison may take the
string "npu", "cpu" or "cuda" (==, !=, in, not in, also against a tuple/set/list holding one),
and outside accelerator/ and ops/npu/ (the NPU kernel front ends) nothing may name torch_npu
in code (imports, names, attributes; docstrings, comments and messages are fine).
"""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "npuspeed"
NAMES = {"npu", "cpu", "cuda"}

def _names_a_device(node) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    if isinstance(node, (ast.Tuple, ast.Set, ast.List)):
        return any(isinstance(e, ast.Constant) and e.value in NAMES for e in node.elts)
    return False


def name_comparisons(source: str) -> list[int]:
    """Lines of comparisons with a device name (either side, any operator of a chain)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_names_a_device(n) for n in [node.left, *node.comparators]):
            lines.append(node.lineno)
    return lines


def torch_npu_uses(source: str) -> list[int]:
    """Lines that import torch_npu or use a name/attribute called torch_npu (strings aside)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch_npu" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch_npu":
            lines.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id == "torch_npu":
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "torch_npu":
            lines.append(node.lineno)
        elif isinstance(node, (ast.FunctionDef, ast.arg)) and getattr(node, "name", getattr(node, "arg", None)) == "torch_npu":
            lines.append(node.lineno)
    return lines


def _files(skip: tuple[str, ...]):
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if not rel.startswith(skip):
            yield rel, path.read_text()


def test_the_checks_catch_what_they_are_for():
    bad = ('if acc.name == "npu": pass\nif t.device.type != "cpu": pass\nok = kind in ("cuda", "x")\n'
           'ok = "cpu" not in {kind}\nimport torch_npu\nfrom torch_npu.contrib import x\nm = acc.torch_npu\n'
           'def f(torch_npu): return torch_npu.npu_swiglu\n')
    assert name_comparisons(bad) == [1, 2, 3, 4]
    assert torch_npu_uses(bad) == [5, 6, 7, 8, 8]  # line 8: the argument and its use
    fine = ('"""torch_npu\'s kernel on an npu"""\nname = "cpu"\nprint(f"device {acc.name}")\n'
            'x = {"cpu": 1}["cpu"]\nif impl == "cpp": pass\n# acc.name == "npu"\n')
    assert name_comparisons(fine) == [] and torch_npu_uses(fine) == []


def test_no_device_name_comparisons_outside_accelerator():
    found = [f"{rel}:{line}" for rel, text in _files(("npuspeed/accelerator/",))
             for line in name_comparisons(text)]
    print("\n".join(found))
    assert not found, ("ask the accelerator (npuspeed/accelerator/capabilities.py, "
                       "accelerator.devices.for_device) instead of comparing a device name:\n" + "\n".join(found))


def test_torch_npu_only_in_accelerator_and_ops_npu():
    found = [f"{rel}:{line}" for rel, text in _files(("npuspeed/accelerator/", "npuspeed/ops/npu/"))
             for line in torch_npu_uses(text)]
    print("\n".join(found))
    assert not found, ("torch_npu is reached through npuspeed/accelerator/ or an NPU front end in "
                       "npuspeed/ops/npu/:\n" + "\n".join(found))


def test_capabilities_answer_per_device_type():
    import torch

    from npuspeed.accelerator import for_device, get_accelerator

    cpu, cuda, npu = (for_device(d) for d in ("cpu", torch.device("cuda", 0), "npu:1"))
    assert cpu.host_is_device() and not (cpu.has_streams() or cpu.has_vendor_kernels() or cpu.runs_cuda_code())
    assert cuda.runs_cuda_code() and cuda.has_sdpa_kernels() and cuda.has_out_dtype_matmul()
    assert not (cuda.host_is_device() or cuda.has_vendor_kernels() or cuda.maps_cuda_itself())
    assert npu.has_vendor_kernels() and npu.maps_cuda_itself() and npu.has_streams()
    assert not (npu.runs_cuda_code() or npu.has_sdpa_kernels() or npu.host_is_device())
    assert for_device(torch.zeros(1)) is cpu
    acc = get_accelerator()  # NPUSPEED_DEVICE=cpu in the suite
    assert acc.host_is_device() and not acc.has_streams() and acc.kernel("npu_fusion_attention") is None
    assert not (acc.has_vendor_kernels() or acc.has_sdpa_kernels() or acc.runs_cuda_code())
    assert acc.triton_available() == cpu.triton_available()


def test_one_triton_answer_for_the_kernels_and_the_codec(monkeypatch):
    from npuspeed.accelerator import for_device
    from npuspeed.features.reuse_fp32_param import triton_codec
    from npuspeed.ops.triton import _runtime

    monkeypatch.setattr(_runtime, "triton_importable", lambda: True)
    monkeypatch.setattr(_runtime, "device_type", lambda: "cuda")  # a CUDA driver is active
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert for_device("cuda").triton_available() and triton_codec.available("cuda")
    assert not (for_device("npu").triton_available() or triton_codec.available("npu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter takes host tensors, the codec there is C++
    assert for_device("cpu").triton_available() and not triton_codec.available("cpu")
    assert not triton_codec.available("cuda")
