"""Modules megatron.training imports at load time whose optional dependency is absent.

`megatron.training.initialize` imports `enable_batch_invariant_mode` from
`megatron.core.transformer.custom_layers.batch_invariant_kernels`, which imports `triton`
at module level (its kernels are Triton GPU kernels). Where triton is not installed (CPU,
NPU) that import would stop `pretrain_gpt.py` before it starts, although the kernels are
used only under `--batch-invariant-mode`. Installing triton is no fix: it is a GPU
compiler, and on a CPU build of torch its presence changes what torch.compile tries.

So, only when triton is absent and the module has not been imported yet, a stand-in is put
in `sys.modules` under that name: the mode reads as off, and turning it on raises an error
naming the flag. Each stand-in is listed by `installed()` for the report.
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
import types

BATCH_INVARIANT = "megatron.core.transformer.custom_layers.batch_invariant_kernels"

_installed: list[str] = []


class BatchInvariantUnavailable(RuntimeError):
    """--batch-invariant-mode asked for where its Triton kernels cannot run."""


def _refuse(*_args, **_kwargs):
    raise BatchInvariantUnavailable(
        "--batch-invariant-mode needs Megatron's Triton kernels (batch_invariant_kernels.py), "
        "and triton is not installed here. Drop --batch-invariant-mode, or run on a CUDA "
        "machine with triton installed."
    )


def _is_enabled() -> bool:
    return False


@contextlib.contextmanager
def _set_mode(enabled: bool = True):
    if enabled:
        _refuse()
    yield


def batch_invariant_stand_in() -> types.ModuleType:
    """The stand-in module: the public names of the real one, mode always off."""
    module = types.ModuleType(BATCH_INVARIANT, "npuspeed stand-in: triton is not installed")
    module.is_batch_invariant_mode_enabled = _is_enabled
    module.enable_batch_invariant_mode = _refuse
    module.disable_batch_invariant_mode = lambda: None
    module.set_batch_invariant_mode = _set_mode
    module.__all__ = ["set_batch_invariant_mode", "is_batch_invariant_mode_enabled",
                      "disable_batch_invariant_mode", "enable_batch_invariant_mode"]
    module.__npuspeed_stand_in__ = "triton is not installed"
    return module


def _absent(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def install() -> list[str]:
    """Put the stand-ins that this machine needs in sys.modules; returns their names."""
    if _absent("triton") and BATCH_INVARIANT not in sys.modules:
        sys.modules[BATCH_INVARIANT] = batch_invariant_stand_in()
        _installed.append(BATCH_INVARIANT)
    return list(_installed)


def uninstall() -> None:
    """Remove the stand-ins again (tests)."""
    while _installed:
        name = _installed.pop()
        if getattr(sys.modules.get(name), "__npuspeed_stand_in__", None):
            del sys.modules[name]


def installed() -> list[str]:
    return list(_installed)
