"""Which linears run in FP8: those called inside a TransformerLayer's forward (as Megatron wraps
each layer, and only the layers, in TE's fp8 context), except the first / last layers kept in
BF16 by `--first-last-layers-bf16` (Megatron's rule: 0-based global layer l is BF16 when
l < num_layers_at_start_in_bf16 or l >= num_layers - num_layers_at_end_in_bf16).

The embedding, the output layer and anything outside a layer keep Megatron's GEMMs. The layer
being run is held in a context variable set by the TransformerLayer.forward wrapper (a layer
re-run by activation recompute sets it again).
"""
from __future__ import annotations

import contextvars
import functools

_CURRENT = contextvars.ContextVar("npuspeed_fp8_layer", default=None)


def current_layer():
    """(0-based global layer number, the layer's config) of the layer running now, or None."""
    return _CURRENT.get()


def bf16_layer(layer_no: int, num_layers: int, config) -> bool:
    if not config.first_last_layers_bf16:
        return False
    return layer_no < config.num_layers_at_start_in_bf16 or layer_no >= num_layers - config.num_layers_at_end_in_bf16


def fp8_layers(num_layers: int, config) -> list[int]:
    return [n for n in range(num_layers) if not bf16_layer(n, num_layers, config)]


def layer_forward(forward):
    """TransformerLayer.forward wrapper: marks its linears as inside layer `layer_number - 1`."""
    @functools.wraps(forward)
    def wrapped(self, *args, **kwargs):
        token = _CURRENT.set((self.layer_number - 1, self.config))
        try:
            return forward(self, *args, **kwargs)
        finally:
            _CURRENT.reset(token)
    return wrapped
