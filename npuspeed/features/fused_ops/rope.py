"""--use-fused-rotary-pos-emb: Megatron's unfused rotary embedding runs the fused op.

`rope_utils.apply_rotary_pos_emb` sends bshd inputs (and each packed thd sequence) to
`_apply_rotary_pos_emb_bshd` unless `config.apply_rope_fusion` picks Transformer Engine's
kernel (which needs TE, absent on CPU and NPU). We wrap `_apply_rotary_pos_emb_bshd`; both
rotate-half and `rotary_interleaved` forms, partial rotary dims and mscale are handled, and
what the fused op does not cover (multi-latent attention's channel reorder, freqs that need
a gradient, other ranks) goes to Megatron's own function. Where npuspeed's Triton kernel runs,
an attention's q and k are rotated together in one launch (rope_qk.py).
"""
from __future__ import annotations

import functools
import inspect

from npuspeed.features.fused_ops import rope_qk
from npuspeed.ops import rope

TARGET = "megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd"
_HANDLED = {"t", "freqs", "rotary_interleaved", "multi_latent_attention", "mscale"}


def fused_bshd(original):
    signature = inspect.signature(original)
    rope_qk._ORIGINAL["bshd"] = original  # Megatron's path of the q+k candidates

    @functools.wraps(original)
    def _apply_rotary_pos_emb_bshd(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if set(a) - _HANDLED or a.get("multi_latent_attention") or not rope.supported(a["t"], a["freqs"]):
            return original(*args, **kwargs)
        rest = {k: v for k, v in a.items() if k != "t"}
        return rope.fused_rotary_pos_emb(a["t"], a["freqs"], bool(a.get("rotary_interleaved", False)),
                                         float(a.get("mscale", 1.0)), lambda t: original(t, **rest))

    return _apply_rotary_pos_emb_bshd


def register(registry, feature: str) -> None:
    registry.register(TARGET, wrapper=fused_bshd, feature=feature)
    rope_qk.register(registry, feature)
