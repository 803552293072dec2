"""Compiler flags for the C++ op library, shared by setup.py and the JIT build.

The kernels use ATen's `at::vec::Vectorized`, whose width is fixed at compile time by the
CPU_CAPABILITY macros (ATen compiles its own kernels once per level and picks one at run
time; we compile once). `NPUSPEED_CPU_CAPABILITY` chooses the level:

- `auto` (default): the best level this machine supports (read from /proc/cpuinfo). Right
  for the JIT build and for `pip install -e .`, which run where the library is used; a
  library built so must not be copied to an older CPU (the loader checks, see
  `unsupported_capability`, and falls back to the references rather than crash).
- `avx512`, `avx2`: that level; `default`: no SIMD flags (portable, slower) for wheels.

Sources come in two sets (`source_files`): csrc/cpu/ builds anywhere (portable C++ and
`at::vec`), csrc/x86/ uses x86 intrinsics (AVX512-BF16 attention) and is compiled only on
x86_64 hosts, or never with NPUSPEED_NO_X86=1 (which is how the tests prove an Arm-style
build works here).

This module imports nothing from npuspeed so that setup.py can load it by path.
"""
from __future__ import annotations

import glob
import os
import platform

LEVELS = {
    "avx512": (("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"),
               ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
                "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]),
    "avx2": (("avx2", "fma", "f16c"),
             ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]),
    "default": ((), []),
}


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def x86_kernels_excluded() -> str | None:
    """Why the x86-only sources are left out of this build, or None when they are built."""
    if os.environ.get("NPUSPEED_NO_X86", "0") not in ("", "0", "false", "False"):
        return "not built for this CPU (NPUSPEED_NO_X86=1 left out the x86 kernels)"
    if not is_x86_64():
        return f"not built for this CPU ({platform.machine()}): the kernel uses x86 AVX-512 intrinsics"
    return None


def source_files(csrc: str) -> list[str]:
    """The .cpp files to compile: csrc/cpu always, csrc/x86 on x86_64 unless excluded."""
    files = sorted(glob.glob(os.path.join(csrc, "cpu", "*.cpp")))
    if x86_kernels_excluded() is None:
        files += sorted(glob.glob(os.path.join(csrc, "x86", "*.cpp")))
    return files


def header_files(csrc: str) -> list[str]:
    return sorted(glob.glob(os.path.join(csrc, "*", "*.h")))


def cpu_flags() -> set[str]:
    """The running CPU's feature flags (empty where /proc/cpuinfo is absent)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def choose_capability() -> str:
    wanted = os.environ.get("NPUSPEED_CPU_CAPABILITY", "auto").lower()
    if wanted in LEVELS:
        return wanted
    if wanted != "auto":
        raise ValueError(f"NPUSPEED_CPU_CAPABILITY={wanted!r}: use auto, avx512, avx2 or default")
    if not is_x86_64():
        return "default"
    have = cpu_flags()
    for level in ("avx512", "avx2"):
        if set(LEVELS[level][0]) <= have:
            return level
    return "default"


def compile_args() -> list[str]:
    """-O3; OpenMP (at::parallel_for is inline and runs serially without it); no implicit
    fused multiply-adds (GCC contracts a*b+c across intrinsics otherwise, and the kernels
    promise eager PyTorch's fp32 rounding where they say so); the SIMD level."""
    args = ["-O3", "-fopenmp", "-ffp-contract=off", *LEVELS[choose_capability()][1]]
    return args + (["-DNPUSPEED_NO_X86"] if x86_kernels_excluded() else [])


def link_args() -> list[str]:
    # Resolves to the libgomp torch already loaded (same soname), not a second runtime.
    return ["-fopenmp"]


def unsupported_capability(level: str) -> str | None:
    """Why a library compiled for `level` cannot run on this CPU, or None if it can."""
    needed = set(LEVELS.get(level, ((),))[0])
    if not needed:
        return None
    have = cpu_flags()
    if not have:  # cannot tell (not Linux): trust the build
        return None
    missing = sorted(needed - have)
    if missing:
        return (f"the op library was compiled for {level} but this CPU lacks {', '.join(missing)}; "
                "rebuild here (pip install --no-build-isolation -e .) or with NPUSPEED_CPU_CAPABILITY=default")
    return None
