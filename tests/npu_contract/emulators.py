"""Every emulator of the contract tier, by torch_npu op name (EMULATOR: not the real ops)."""
from __future__ import annotations

import importlib

MODULES = ("npu_contract.emulate_norm", "npu_contract.emulate_moe", "npu_contract.emulate_comm",
           "npu_contract.emulate_attention")


def all_emulators() -> dict:
    found: dict = {}
    for name in MODULES:
        found.update(importlib.import_module(name).EMULATORS)
    return found
