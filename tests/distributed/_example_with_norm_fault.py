"""Test-only runner: the example, unchanged, with a fault injected into layer 2's (layer_number 2,
`decoder.layers.1`) input norm: its forward output times (1 + NPUSPEED_TEST_NORM_FAULT), a
relative error of that size. Never part of the product: tests/distributed/test_dump_compare.py
checks that `npuspeed compare` names that module, forward."""
import os
import runpy
import sys

import torch  # noqa: F401

import npuspeed.megatron_adaptor  # noqa: F401  (the example imports it too: once)

from megatron.core.transformer import transformer_layer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
from launch import EXAMPLE  # noqa: E402

ERROR = float(os.environ["NPUSPEED_TEST_NORM_FAULT"])
_init = transformer_layer.TransformerLayer.__init__


def _faulty_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    if self.layer_number == 2:
        self.input_layernorm.register_forward_hook(lambda module, inputs, output: output * (1 + ERROR))


transformer_layer.TransformerLayer.__init__ = _faulty_init
sys.argv = [str(EXAMPLE), *sys.argv[1:]]
runpy.run_path(str(EXAMPLE), run_name="__main__")
