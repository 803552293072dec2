"""Finding or building the `npuspeed::` C++ op library.

Order: the library `pip install` built for this interpreter (npuspeed/_C.<ABI suffix>.so:
one checkout can serve a Python 3.11 and a 3.12 venv, each with its own torch), else (none, or
it does not load against this torch) a JIT build of csrc/ into a cache directory keyed by the
torch version, else nothing, and every caller runs its pure-PyTorch reference.
What happened is kept in `status()` for `npuspeed report`, and the fallback is logged once.
`NPUSPEED_DISABLE_CPP=1` stands in for a machine without a compiler; `NPUSPEED_JIT=1` skips
the pip-built library and JIT-builds csrc/ (with NPUSPEED_NO_X86=1: the portable set only, as
an Arm host builds it; the tests use this).

torch's JIT builder guards its build folder with a lock file that a killed build leaves
behind, after which every later build waits forever. We serialise builds with our own
`fcntl` lock, so any torch lock file found while we hold ours is stale and is removed.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import logging
import os
from pathlib import Path

import torch

from npuspeed.ops import build_flags

log = logging.getLogger("npuspeed")

_PACKAGE_DIR = Path(__file__).resolve().parent.parent
_CSRC = _PACKAGE_DIR.parent / "csrc"
_STATUS: dict | None = None


def cpp_disabled() -> bool:
    return os.environ.get("NPUSPEED_DISABLE_CPP", "0") not in ("", "0", "false", "False")


def source_files() -> list[str]:
    return build_flags.source_files(str(_CSRC))


def _prebuilt() -> str | None:
    if os.environ.get("NPUSPEED_JIT", "0") not in ("", "0", "false", "False"):
        return None
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:  # this interpreter's ABI first
        path = _PACKAGE_DIR / f"_C{suffix}"
        if suffix != ".so" and path.is_file():
            return str(path)
    return None


def _cache_dir(sources: list[str]) -> Path:
    digest = hashlib.sha256(torch.__version__.encode())
    digest.update(" ".join(build_flags.compile_args()).encode())
    for src in sources + build_flags.header_files(str(_CSRC)):
        digest.update(Path(src).read_bytes())
    root = Path(os.environ.get("NPUSPEED_CACHE", Path.home() / ".cache" / "npuspeed"))
    return root / f"build-{digest.hexdigest()[:16]}"


def _jit_build(sources: list[str]) -> str:
    import fcntl

    from torch.utils.cpp_extension import load

    build_dir = _cache_dir(sources)
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "npuspeed.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("npuspeed: removing stale build lock %s", stale)
            stale.unlink()
        load(
            name="npuspeed_C",
            sources=sources,
            build_directory=str(build_dir),
            extra_cflags=build_flags.compile_args(),
            extra_ldflags=build_flags.link_args(),
            is_python_module=False,
            verbose=False,
        )
    return str(build_dir / "npuspeed_C.so")


def load_library() -> dict:
    """Load the op library once; return its status (never raises)."""
    global _STATUS
    if _STATUS is not None:
        return _STATUS
    status = {"compiled": False, "source": None, "path": None, "error": None, "cpu_capability": None}
    if cpp_disabled():
        status.update(source="disabled", error="NPUSPEED_DISABLE_CPP is set")
    else:
        path = _prebuilt()
        status["source"] = "prebuilt" if path else "jit"
        try:
            if path is not None:
                try:
                    torch.ops.load_library(path)
                except OSError as exc:  # built against another torch: build for this one
                    log.warning("npuspeed: %s does not load with torch %s (%s); JIT-building csrc/",
                                path, torch.__version__, str(exc).splitlines()[0][:200])
                    status["source"], path = "jit", None
            if path is None:
                if not source_files():
                    raise RuntimeError(f"no C++ sources under {_CSRC} and no prebuilt library")
                path = _jit_build(source_files())
            status.update(compiled=True, path=path)
            if hasattr(torch.ops.npuspeed, "cpu_capability"):
                status["cpu_capability"] = level = torch.ops.npuspeed.cpu_capability()
                problem = build_flags.unsupported_capability(level)
                if problem:
                    raise RuntimeError(problem)
        except Exception as exc:  # a missing compiler must not stop training
            status.update(source="failed", error=f"{type(exc).__name__}: {exc}".strip()[:2000])
    if not status["compiled"]:
        log.warning(
            "npuspeed: C++ op library unavailable (%s); using pure-PyTorch references",
            status["error"],
        )
    _STATUS = status
    return status


def has_op(name: str) -> bool:
    return load_library()["compiled"] and hasattr(torch.ops.npuspeed, name)
