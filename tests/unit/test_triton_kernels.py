"""npuspeed's Triton kernels on CPU through Triton's interpreter (the CPU tier's checks and the
device tier's kernel tests), and their import without triton.

The numerics (every op against its pure-PyTorch reference, forward and backward, fp32 and
bf16, odd shapes) live in _triton_kernel_checks.py and run here in a fresh process with
TRITON_INTERPRET=1 set before triton is imported: in this process another test may have
imported triton already, and triton.language's own jitted helpers (tl.sum) are fixed at that
import, so setting the flag later would not make the kernels interpretable.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
from script_run import run_triton_script

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _env(**extra):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def _interpreted(path: pathlib.Path, marks: str, at_least: int) -> None:
    """`pytest -m marks path` in a fresh process with TRITON_INTERPRET=1: every test passes, none
    skips, and at least `at_least` ran."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e .[test] on Linux x86_64)")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marks, str(path)],
                          cwd=ROOT, env=_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600)
    report = proc.stdout[-8000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= at_least and "skipped" not in proc.stdout, report


def test_kernels_match_the_references_under_the_interpreter():
    _interpreted(HERE / "_triton_kernel_checks.py", "not slow", 20)


def test_the_device_tiers_kernel_tests_pass_under_the_interpreter():
    """The harness of tests/device/test_triton_kernels_on_device.py (the same checks on the GPU or
    NPU itself) on CPU tensors: its gate, its odd shapes at the kernels' real block caps, and the
    fused-op rule offering each kernel where Triton runs."""
    _interpreted(ROOT / "tests" / "device" / "test_triton_kernels_on_device.py", "device", 25)


def test_import_without_triton_leaves_available_false():
    probe = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
             "import npuspeed.ops.triton.rms_norm as a, npuspeed.ops.triton.swiglu as b\n"
             "import npuspeed.ops.triton.rope as c, npuspeed.ops.triton.moe_permute as d\n"
             "print(a.available(), b.available(), c.available(), d.available())")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=_env(TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False"] * 4


# Every kernel through Triton's real compiler (TTIR -> PTX -> cubin with the ptxas that ships
# in the triton wheel) for an H100 and an MI300, with no GPU here: the interpreter runs the
# kernels as Python and cannot catch what only the compiler rejects (types merging across
# constexpr branches, pointer arithmetic widths, reductions).
_PTR = {"H@rms_norm": "*bf16", "RSTD": "*fp32", "DWP": "*fp32", "COS": "*fp32", "SIN": "*fp32", "W@moe_permute": "*fp32",
        "IDX": "*i64", "ORDER": "*i64", "STARTS": "*i64", "COUNTS": "*i64", "OUT": "*fp32"}
_SIZES = {"N", "M", "F", "H", "B", "HQ", "HK", "D", "ROT"}  # int arguments named in capitals
_COMPILE_CASES = [
    ("rms_norm", "_fwd", {"HAS_W": True, "HAS_RES": True, "BLOCK": 4096}, 8),
    ("rms_norm", "_bwd", {"HAS_W": True, "HAS_DH": True, "WANT_DW": True, "ROWS": 16, "BLOCK": 4096}, 8),
    ("swiglu", "_fwd", {"BLOCK": 1024}, 4),
    ("swiglu", "_bwd", {"BLOCK": 1024}, 4),
    ("rope", "_rope", {"BACKWARD": True, "INTERLEAVED": False, "BLOCK_H": 32, "BLOCK_D": 128}, 8),
    ("moe_permute", "_gather", {"HAS_W": True, "BLOCK": 1024}, 4),
    ("moe_permute", "_row_dot", {"NCB": 4, "BLOCK": 1024}, 4),
    ("moe_permute", "_reduce", {"HAS_W": True, "MAX_K": 8, "BLOCK": 1024}, 4),
]


def _compile_all(target: str) -> list[str]:
    """Compile every kernel for `target` (cuda: an H100, hip: an MI300); the kernels compiled."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    gpu = GPUTarget("cuda", 90, 32) if target == "cuda" else GPUTarget("hip", "gfx942", 64)
    done = []
    for module_name, kernel, constexprs, warps in _COMPILE_CASES:
        module = importlib.import_module(f"npuspeed.ops.triton.{module_name}")
        fn = getattr(module._k(), kernel)
        assert type(fn).__name__ == "JITFunction"
        signature = {}
        for arg in fn.arg_names:
            if arg in constexprs:
                signature[arg] = "constexpr"
            elif arg == "eps":
                signature[arg] = "fp32"
            elif f"{arg}@{module_name}" in _PTR:
                signature[arg] = _PTR[f"{arg}@{module_name}"]
            elif arg[0].isupper() and arg not in _SIZES:  # tensors are named in capitals
                signature[arg] = _PTR.get(arg, "*bf16")
            else:
                signature[arg] = "i32"
        compiled = triton.compile(ASTSource(fn, signature, constexprs), target=gpu, options={"num_warps": warps})
        binary = "cubin" if target == "cuda" else "hsaco"
        assert compiled.asm.get(binary), f"{module_name}.{kernel}: no {binary}"
        done.append(f"{module_name}.{kernel}")
    return done


# In a fresh interpreter: triton's own jitted helpers (tl.sum) take the mode of the process's
# first triton import, and in a test session that may have been under TRITON_INTERPRET=1
# (another Triton test file), after which nothing compiles for a GPU in that process.
_COMPILE_SCRIPT = ("import json, sys; sys.path[:0] = ['tests', 'tests/unit']\n"
                   "import test_triton_kernels as t; print(json.dumps(t._compile_all(sys.argv[1])))")


@pytest.mark.parametrize("target", ["cuda", "hip"])
def test_every_kernel_compiles_for_gpus_without_one(target, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the compiled-mode JITFunctions
    done = run_triton_script(_COMPILE_SCRIPT, target, timeout=600)
    assert done == [f"{m}.{k}" for m, k, _, _ in _COMPILE_CASES]


def test_interpreter_flag_set_after_triton_import_is_refused_with_the_fix():
    pytest.importorskip("triton", reason="triton is not installed (pip install -e .[test] on Linux x86_64)")
    probe = ("import os, torch, triton, triton.language\n"
             "os.environ['TRITON_INTERPRET'] = '1'\n"
             "from npuspeed.ops.triton import rms_norm\n"
             "try:\n    rms_norm.rms_norm(torch.randn(2, 8), None)\nexcept RuntimeError as e:\n    print(e)\n")
    env = _env()
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "set it before the process imports triton" in proc.stdout
