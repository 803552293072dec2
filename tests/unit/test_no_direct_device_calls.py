"""Only npuspeed/accelerator/ talks to torch.cuda or torch_npu; importing npuspeed changes nothing.

The first check reads the syntax tree, so patch targets written as strings
("torch.cuda.current_device") are fine while calls and imports are not.
"""
from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "npuspeed"


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def violations(source: str) -> list[str]:
    """`torch.cuda.<name>(...)` calls and torch_npu / torch.cuda imports in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name and name.startswith("torch.cuda."):
                found.append(f"line {node.lineno}: call {name}(")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch_npu" or alias.name.startswith("torch.cuda"):
                    found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = {a.name for a in node.names}
            if module.split(".")[0] == "torch_npu" or module.startswith("torch.cuda") or (
                module == "torch" and names & {"cuda", "npu"}
            ):
                found.append(f"line {node.lineno}: from {module} import {', '.join(sorted(names))}")
    return found


def test_checker_catches_what_it_should():
    bad = (
        "import torch\nimport torch_npu\nfrom torch_npu.contrib import transfer_to_npu\n"
        "from torch import cuda\nimport torch.cuda.nvtx\n"
        "x = torch.cuda.current_device()\ntorch.cuda.nvtx.range_push('a')\n"
    )
    assert len(violations(bad)) == 6
    fine = (
        "registry.register('torch.cuda.current_device', f)\n"
        "s = f'torch.cuda.{name}'\n# torch.cuda.synchronize()\nimport torch\n"
        "x = torch.cpu.synchronize()\n"
    )
    assert violations(fine) == []


def test_no_direct_device_calls_outside_accelerator():
    files = [p for p in PACKAGE.rglob("*.py") if "accelerator" not in p.relative_to(PACKAGE).parts]
    assert len(files) > 10
    found = {}
    for path in files:
        hits = violations(path.read_text())
        if hits:
            found[str(path.relative_to(PACKAGE.parent))] = hits
    assert not found, f"use npuspeed.accelerator.get_accelerator() instead: {found}"


_SIDE_EFFECT_PROBE = r"""
import importlib, importlib.util, json, pkgutil, sys
import torch, torch.distributed, torch.cuda.nvtx

# torch's own lazy caches, filled by torch on first use whoever triggers it (torch 2.14:
# torch.distributed._spmd_types_available, set when megatron.core imports): filled first
getattr(torch.distributed, "_is_spmd_types_available", lambda: None)()
watched = {m.__name__: m for m in (torch.cuda, torch.distributed, torch.cuda.nvtx)}
def snap():
    return {name: dict(vars(m)) for name, m in watched.items()}
before = snap()
import npuspeed
from npuspeed.patching import registry

def changed():
    out = []
    for name, attrs in before.items():
        now = vars(watched[name])
        out += [f"{name}.{k}" for k, v in attrs.items() if now.get(k) is not v]
    return out

names = sorted(m.name for m in pkgutil.walk_packages(npuspeed.__path__, "npuspeed.")
               if importlib.util.find_spec(m.name).origin.endswith(".py"))  # not the op library
problems = {}
for name in names:
    if name == "npuspeed.megatron_adaptor":
        continue
    importlib.import_module(name)
    bad = changed() + [p["target"] for p in registry.report()]
    if torch.cuda.current_device is not before["torch.cuda"]["current_device"]:
        bad.append("torch.cuda.current_device replaced")
    if bad:
        problems[name] = bad
        break
print(json.dumps({"modules": names, "problems": problems,
                  "adaptor_loaded": "npuspeed.megatron_adaptor" in sys.modules}))
"""


def test_importing_npuspeed_modules_has_no_side_effects():
    proc = subprocess.run([sys.executable, "-c", _SIDE_EFFECT_PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "npuspeed.patching.registry" in result["modules"]
    assert "npuspeed.features.device.cuda_shim" in result["modules"]
    assert result["problems"] == {}, "module-level side effects (only megatron_adaptor may have them)"
    assert result["adaptor_loaded"] is False
