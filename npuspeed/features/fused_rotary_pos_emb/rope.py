"""--use-fused-rotary-pos-emb: Megatron's unfused rotary embedding runs the fused op.

`rope_utils.apply_rotary_pos_emb` sends bshd inputs (and each packed thd sequence) to
`_apply_rotary_pos_emb_bshd` unless `config.apply_rope_fusion` picks Transformer Engine's
kernel (which needs TE, absent on CPU and NPU). We wrap `_apply_rotary_pos_emb_bshd`; both
rotate-half and `rotary_interleaved` forms, partial rotary dims and mscale are handled, and
what the fused op does not cover (multi-latent attention's channel reorder, freqs that need
a gradient, other ranks) goes to Megatron's own function. Where npuspeed's Triton kernel runs,
an attention's q and k are rotated together in one launch (rope_qk.py).

The keywords differ by release: 0.12-0.18 name the MLA reorder `multi_latent_attention`;
0.19 names it `mla_rotary_interleaved` and keeps the old name as a deprecated alias (default
None). A release whose function takes a keyword not known here is refused at start-up
(a fused path that checks only known keywords would otherwise fall back on every call).
"""
from __future__ import annotations

import functools
import inspect

from npuspeed.features.base import FeatureError
from npuspeed.features.fused_rotary_pos_emb import rope_qk
from npuspeed.ops import rope

TARGET = "megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd"
#: the MLA channel reorder, by its name in each release (0.19's first, then its deprecated alias)
MLA = ("mla_rotary_interleaved", "multi_latent_attention")
_HANDLED = {"t", "freqs", "rotary_interleaved", "mscale", *MLA}


def mla_keyword(original) -> str:
    """The name this release's `_apply_rotary_pos_emb_bshd` gives the MLA reorder."""
    params = inspect.signature(original).parameters
    return next(name for name in MLA if name in params)


def fused_bshd(original):
    signature = inspect.signature(original)
    unknown = set(signature.parameters) - _HANDLED
    if unknown or not any(name in signature.parameters for name in MLA):
        from npuspeed.patching.versions import megatron_version

        raise FeatureError(
            f"--use-fused-rotary-pos-emb: megatron-core {megatron_version()}'s _apply_rotary_pos_emb_bshd takes "
            f"{', '.join(sorted(unknown)) or 'no MLA keyword'}, which this npuspeed does not know (it would "
            "fall back to Megatron's RoPE on every call); drop --use-fused-rotary-pos-emb or use a "
            "supported megatron-core (0.12-0.19)")
    rope_qk._ORIGINAL["bshd"] = original  # Megatron's path of the q+k candidates
    rope_qk._ORIGINAL["mla"] = mla_keyword(original)

    @functools.wraps(original)
    def _apply_rotary_pos_emb_bshd(*args, **kwargs):
        a = signature.bind(*args, **kwargs).arguments  # only what the caller gave
        if any(a.get(name) for name in MLA) or not rope.supported(a["t"], a["freqs"]):
            return original(*args, **kwargs)
        rest = {k: v for k, v in a.items() if k != "t"}
        return rope.fused_rotary_pos_emb(a["t"], a["freqs"], bool(a.get("rotary_interleaved", False)),
                                         float(a.get("mscale", 1.0)), lambda t: original(t, **rest))

    return _apply_rotary_pos_emb_bshd

