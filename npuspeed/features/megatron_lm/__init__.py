"""Megatron-LM integration (on whenever `megatron.training` is importable).

Megatron-LM's `pretrain_gpt.py` parses its own command line and rejects flags it does not
know; its parser learns npuspeed's group so an unchanged launch script carrying
`--use-fused-rmsnorm` etc. keeps working. Flags Megatron-LM already defines (such as
`--use-flash-attn`) are shared, not redefined.
"""
from __future__ import annotations

import importlib.util

from npuspeed.arguments import megatron_lm_parse_args_wrapper
from npuspeed.features.base import Feature


def megatron_lm_present() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


class MegatronLMFeature(Feature):
    name = "megatron_lm"
    always_on = True

    def enabled(self, args) -> bool:
        return megatron_lm_present()

    def register_patches(self, registry, args, accelerator) -> None:
        registry.register("megatron.training.arguments.parse_args",
                          wrapper=megatron_lm_parse_args_wrapper, feature=self.name)

    def path(self, args, accelerator) -> str:
        return "megatron.training found: its parser learns npuspeed's flags"
