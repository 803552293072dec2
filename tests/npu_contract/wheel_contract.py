"""What a torch_npu wheel says about its ops: schemas from the codegen yaml and the ATB library,
meta functions from `op_plugin/meta/_meta_registrations.py`, executed with torch_npu's few
imports stubbed and its `@impl(m, "op")` decorator recording instead of registering.
"""
from __future__ import annotations

import ast
import re
import sys
import types
from pathlib import Path

import torch

YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
META = "torch_npu/op_plugin/meta/_meta_registrations.py"
ATB_SO = "torch_npu/lib/libop_plugin_atb.so"
_FUNC = re.compile(r"^\s*(?:-\s*)?func:\s*(.+?)\s*$")


def schemas(root: Path) -> dict[str, str]:
    """op name (with overload, e.g. 'npu_foo.out') -> schema string, as the yaml declares them."""
    found: dict[str, str] = {}
    for line in (root / YAML).read_text().splitlines():
        m = _FUNC.match(line)
        if m:
            text = m.group(1)
            found.setdefault(text.split("(", 1)[0], text)
    return found


#: the ATB kernels' C++ signatures, as their mangled symbols spell them (the wheel has no schema
#: text for them: the library registers a C++ function pointer): op -> schema
_ATB_SIGNATURES = {
    # void atb::_npu_matmul_add_fp32(const at::Tensor&, const at::Tensor&, at::Tensor&)
    "_ZN3atb20_npu_matmul_add_fp32ERKN2at6TensorES3_RS1_":
        ("_npu_matmul_add_fp32", "_npu_matmul_add_fp32(Tensor x, Tensor weight, Tensor(a!) C) -> ()"),
}


def atb_schemas(root: Path) -> dict[str, str]:
    """ATB ops whose kernel symbol (with exactly this C++ signature) the wheel's library holds."""
    path = root / ATB_SO
    if not path.exists():
        return {}
    data = path.read_bytes()
    return {op: schema for symbol, (op, schema) in _ATB_SIGNATURES.items() if symbol.encode() in data}


class _Recorder:
    """Stands in for torch.library's `impl`: keeps (op -> function) for the 'Meta' library."""

    def __init__(self):
        self.found: dict[str, object] = {}

    def impl(self, lib, name, *args, **kwargs):
        def keep(fn):
            if getattr(lib, "ns", None) == "npu":
                self.found[name] = fn
            return fn
        return keep


class _Library:
    def __init__(self, ns, kind, key=""):
        self.ns, self.kind, self.key = ns, kind, key

    def impl(self, *args, **kwargs):
        return None

    def define(self, *args, **kwargs):
        return None


def meta_functions(root: Path, torch_npu_stub: types.ModuleType) -> dict[str, object]:
    """op name -> the wheel's own meta function for it."""
    source = (root / META).read_text()
    recorder = _Recorder()
    error_code = types.SimpleNamespace(ErrCode=_ErrCode, ops_error=lambda *a, **k: "")
    stubs = {
        "torch_npu": torch_npu_stub,
        "torch_npu.utils": types.ModuleType("torch_npu.utils"),
        "torch_npu.utils._error_code": error_code,
        "torch_npu.npu.utils": types.SimpleNamespace(get_cann_version=lambda *a, **k: "8.3.RC1"),
        "torch_npu.npu._backends": types.SimpleNamespace(get_soc_version=lambda *a, **k: 250),
    }
    saved = {name: sys.modules.get(name) for name in stubs}
    import torch.library as library
    real = (library.Library, library.impl)
    try:
        sys.modules.update(stubs)
        library.Library, library.impl = _Library, recorder.impl
        namespace = {"__name__": "torch_npu_contract_meta", "__file__": str(root / META)}
        # Statement by statement: a few module-level lines touch ops of other torch_npu parts
        # (`has_side_effect(torch.ops.npu.npu_prefetch.default)`); those are left out, the
        # constants, helpers and meta functions all run.
        for node in ast.parse(source).body:
            try:
                exec(compile(ast.Module([node], []), str(root / META), "exec"), namespace)
            except Exception:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    raise
    finally:
        library.Library, library.impl = real
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return recorder.found


class _ErrCode:
    """torch_npu.utils._error_code.ErrCode: only its members are read, as message parts."""

    def __getattr__(self, name):
        return name

    def __class_getitem__(cls, item):
        return item


for _name in ("PARAM", "TYPE", "VALUE", "NOT_SUPPORT", "UNAVAIL", "INTERNAL"):
    setattr(_ErrCode, _name, _name)
