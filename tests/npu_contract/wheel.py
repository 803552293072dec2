"""torch_npu's own contract files, read from its wheels (fetched once, never committed).

A torch_npu wheel does not import without CANN, but its op schemas (the codegen yaml), its meta
functions (`op_plugin/meta`), its ATB kernel library (whose symbols name `_npu_matmul_add_fp32`'s
C++ signature) and the Python of `torch_npu.npu` are plain files. `files(release)` downloads
the wheel with `pip download --no-deps` (any CPython's wheel: these files are the same in each),
unpacks only those files under the cache and returns the folder.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

#: the oldest torch_npu whose torch npuspeed runs on, one in the middle, the newest on the index
RELEASES = ("2.6.0", "2.9.0", "2.14.0")
#: the wheel members the contract reads
MEMBERS = (
    "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml",
    "torch_npu/op_plugin/meta/_meta_registrations.py",
    "torch_npu/op_plugin/atb/_atb_ops.py",
    "torch_npu/lib/libop_plugin_atb.so",
    "torch_npu/npu/__init__.py",
    "torch_npu/npu/streams.py",
    "torch_npu/npu/memory.py",
    "torch_npu/npu/random.py",
    "torch_npu/npu/utils.py",
    "torch_npu/contrib/transfer_to_npu.py",
    "torch_npu/__init__.py",
    "torch_npu/_op_plugin_docs.py",  # the documented limits the emulators enforce
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get("NPUSPEED_TORCH_NPU_CACHE") or Path(base) / "npuspeed" / "torch_npu")


def files(release: str) -> Path:
    """The unpacked contract files of torch_npu `release` (fetched on first use)."""
    root = cache_root() / release
    if (root / "COMPLETE").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        wheel = _download(release, Path(tmp))
        staged = Path(tmp) / "files"
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
            for member in MEMBERS:
                if member in names:  # an older wheel may lack one (then its check says so)
                    archive.extract(member, staged)
        (staged / "COMPLETE").write_text(wheel.name + "\n")
        try:
            os.replace(staged, root)  # atomic: a parallel run either wins or finds it complete
        except OSError:
            if not (root / "COMPLETE").exists():
                raise
    return root


def _download(release: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
           "--python-version", "3.11", "--implementation", "cp", "-d", str(into), f"torch_npu=={release}"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("torch_npu-*.whl"))
    if done.returncode != 0 or not wheels:
        raise RuntimeError(f"could not download torch_npu=={release} for the NPU contract tier "
                           f"(pip exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return wheels[0]


def version_of(root: Path) -> str:
    return root.name


def clear(release: str) -> None:
    shutil.rmtree(cache_root() / release, ignore_errors=True)
