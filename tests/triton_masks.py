"""Every mask a kernel hands Triton's interpreter must be boolean, on every triton version.

triton 3.9's interpreter refuses any other mask ("mask has unsupported dtype"); 3.6-3.8 read
an integer mask as truthy, so a kernel that builds one passes the pinned triton's tests and
fails under the newest. This wraps the interpreter's masked load and store for the duration
of a test so the pinned version catches it too.
"""
from __future__ import annotations

import contextlib

import numpy as np


@contextlib.contextmanager
def boolean_masks_only():
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    seen = []

    def checked(name, mask_at):
        real = getattr(builder, name)

        def wrapper(self, *args, **kwargs):
            mask = args[mask_at]
            seen.append(mask.data.dtype)
            assert mask.data.dtype == np.bool_, f"{name}: a {mask.data.dtype} mask (must be boolean)"
            return real(self, *args, **kwargs)

        return real, wrapper

    # (ptrs, mask, other, ...) and (ptrs, value, mask, ...) in triton 3.6 through 3.9
    patched = {name: checked(name, at) for name, at in (("create_masked_load", 1), ("create_masked_store", 2))}
    for name, (_, wrapper) in patched.items():
        setattr(builder, name, wrapper)
    try:
        yield seen
    finally:
        for name, (real, _) in patched.items():
            setattr(builder, name, real)
