"""The fused-attention EMULATORS (tests/unit/npu_fusion_attention_emulator.py) for the stand-in."""
from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "unit" / "npu_fusion_attention_emulator.py"


def _load():
    spec = importlib.util.spec_from_file_location("npu_fusion_attention_emulator_contract", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_EMU = _load()
EMULATORS = {"npu_fusion_attention": _EMU.npu_fusion_attention,
             "npu_fusion_attention_grad": _EMU.npu_fusion_attention_grad}
