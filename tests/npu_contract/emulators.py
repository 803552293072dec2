"""Every emulator of the contract tier, by torch_npu op name (EMULATOR: not the real ops)."""
from __future__ import annotations

import importlib

MODULES = ("npu_contract.emulate_norm", "npu_contract.emulate_moe", "npu_contract.emulate_comm",
           "npu_contract.emulate_attention")


def all_emulators(release: str | None = None) -> dict:
    """The emulators of `release` (where releases differ, e.g. rms_norm's dgamma dtype), or the
    newest's."""
    found: dict = {}
    for name in MODULES:
        module = importlib.import_module(name)
        found.update(module.emulators(release) if release and hasattr(module, "emulators") else module.EMULATORS)
    return found
