"""EMULATOR (not the real op) support: how every emulator states a violated documented limit.

The emulators follow torch_npu's own documentation (`torch_npu/_op_plugin_docs.py` in the
2.6.0, 2.9.0 and 2.14.0 wheels); a call outside what it documents raises ValueError naming the
op and the limit, so a contract test fails where the real kernel would refuse or misbehave.
Cases the documentation allows but no emulator models raise NotImplementedError instead.
"""
from __future__ import annotations

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
HALVES = (torch.float16, torch.bfloat16)


def limit(op: str, ok, text: str) -> None:
    """Raise ValueError('op: text') unless `ok` (the documented limit holds)."""
    if not ok:
        raise ValueError(f"{op}: {text} (torch_npu's documented limit)")


def dtype_in(op: str, name: str, t: torch.Tensor, allowed) -> None:
    limit(op, t.dtype in allowed, f"{name} dtype must be one of {[str(d) for d in allowed]}, got {t.dtype}")


def not_modeled(op: str, text: str):
    raise NotImplementedError(f"{op} emulator: {text} is not modeled (npuspeed does not call it so)")


def has_values(t: torch.Tensor) -> bool:
    """Whether the tensor's values can be read (a value limit is checked only then)."""
    return t.device.type != "meta" and not isinstance(t, torch._subclasses.FakeTensor)
