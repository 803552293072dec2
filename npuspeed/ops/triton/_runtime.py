"""What the Triton kernels share: the lazy import, where they can run, block sizes, and the
per-mode cache of compiled kernels.

Kernels are plain module-level functions whose `tl` global is bound here on first use and
wrapped with `triton.jit` then. `triton.jit` decides at wrap time whether it builds an
interpreted function (TRITON_INTERPRET=1) or a compiled one, so the cache is keyed by that
mode. triton.language's own jitted helpers (tl.sum) are wrapped when triton is imported, so
the interpreter needs TRITON_INTERPRET set before that import: `kernels()` says so if not.
Loops in the kernels have constexpr trip counts only: triton 3.6's interpreter cannot take a
runtime loop bound with numpy >= 2.4 (triton-lang/triton#9171), and fixed trip counts suit
triton-ascend's compiler as well.
Masks are built from block comparisons only: triton 3.9's interpreter refuses a mask that is
not boolean ("mask has unsupported dtype"), and a scalar comparison joined to a block mask
(`cols < N & row < M`) is broadcast there as an integer block (the interpreter keeps the
operands' integer dtype on a comparison), which 3.6-3.8 read as truthy. A row's liveness
enters as the bound instead: `cols < tl.where(row < M, N, 0)`.
"""
from __future__ import annotations

import functools
import importlib
import os
import types

from npuspeed.ops import _dispatch

_KERNELS: dict = {}
_DEVICE_OF_BACKEND = {"cuda": "cuda", "hip": "cuda", "npu": "npu", "xpu": "xpu"}
DTYPES = ("float32", "bfloat16", "float16")  # fp32 math inside; fp64 is left to the references
MAX_ROW = 16384  # widest row one program holds (RMSNorm; its backward keeps dW in registers too: beyond this it spills)


def interpreting() -> bool:
    """TRITON_INTERPRET as triton reads it (1/true/yes/on)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def triton_importable() -> bool:
    try:
        importlib.import_module("triton.language")
    except Exception:
        return False
    return True


@functools.lru_cache(maxsize=None)
def device_type() -> str | None:
    """The torch device type triton's active driver targets (cuda, npu, ...), None when none."""
    if not triton_importable():
        return None
    try:
        from triton.runtime import driver

        backend = driver.active.get_current_target().backend
    except Exception:  # no GPU/NPU driver here
        return None
    return _DEVICE_OF_BACKEND.get(backend, backend)


def available() -> bool:
    """Triton imports and can run kernels: a device it targets, or its interpreter (on CPU)."""
    if not triton_importable():
        return False
    return interpreting() or device_type() is not None


def runs_on(*tensors) -> bool:
    """Whether the kernels can take these tensors: all on the device triton targets, or all on
    the CPU under the interpreter."""
    kinds = {t.device.type for t in tensors}
    return len(kinds) == 1 and runs_on_type(kinds.pop())


def runs_on_type(kind: str) -> bool:
    """npuspeed's one Triton-availability answer for tensors of torch device type `kind`
    (Accelerator.triton_available() and the reuse-fp32-param codec read it): the interpreter
    takes host tensors, else triton's active driver must target `kind`."""
    if not triton_importable():
        return False
    if interpreting():
        return kind in _dispatch.HOST_DEVICE_TYPES
    return kind == device_type()


def supported_dtype(*tensors) -> bool:
    return all(str(t.dtype).removeprefix("torch.") in DTYPES for t in tensors)


def check_runs_on(op: str, *tensors) -> None:
    if not runs_on(*tensors):
        where = sorted({str(t.device) for t in tensors})
        raise RuntimeError(f"npuspeed.ops.triton.{op}: Triton cannot run on {where} here "
                           f"(triton importable: {triton_importable()}, targets: {device_type()}, "
                           f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r}); "
                           f"check npuspeed.ops.triton.{op}.available() first")


def pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def block(n: int, cap: int) -> int:
    """Next power of two of the row width `n`, capped at `cap` (a power of two)."""
    return min(pow2(max(n, 1)), cap)


def warps(block_elems: int) -> int:
    return 4 if block_elems <= 2048 else 8 if block_elems <= 8192 else 16


def kernels(module: types.ModuleType, names: tuple[str, ...], no_specialize: tuple[str, ...] = ()):
    """The functions `names` of `module`, jitted for the current mode (compiled once per mode)."""
    key = (module.__name__, interpreting())
    hit = _KERNELS.get(key)
    if hit is None:
        triton = importlib.import_module("triton")
        module.tl = importlib.import_module("triton.language")
        if key[1] and type(module.tl.sum).__name__ != "InterpretedFunction":
            raise RuntimeError("npuspeed.ops.triton: TRITON_INTERPRET=1 was set after triton was imported; "
                               "triton.language's own jitted helpers (tl.sum) are compiled-mode, so the "
                               "interpreter cannot run the kernels: set it before the process imports triton")
        hit = types.SimpleNamespace(**{
            name: triton.jit(getattr(module, name), do_not_specialize=list(no_specialize)) for name in names})
        _KERNELS[key] = hit
    return hit
