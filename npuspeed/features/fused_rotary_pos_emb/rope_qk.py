"""--use-fused-rotary-pos-emb on q and k in one launch, where npuspeed's Triton kernel runs.

Megatron's `Attention.forward` (megatron-core 0.12-0.19) calls `apply_rotary_pos_emb` on the
query, then on the key, with the same angles in self-attention. Rewriting that forward to make
one call would copy a 250-line method per release; instead three small wrappers pair the calls:

- `Attention.forward` opens a scope for one call when q and k will be rotated by the same
  angle tensor through Megatron's unfused bshd path (self-attention, no inference context, no
  packed sequences, no flash decode, no TE rope fusion, no multi-latent attention) on a device
  whose tensors may take Triton kernels;
- `SelfAttention.get_query_key_value_tensors` records the (query, key) it returns in that scope;
- `apply_rotary_pos_emb`, called on that very query with those angles, rotates q and k together
  (npuspeed.ops.rope.fused_rotary_pos_emb_qk: the per-shape rule among one Triton launch, two
  launches of the one-tensor kernel, the native op and Megatron's path) and keeps k's result;
  the next call, on that very key (unchanged: same version) with the same angles and mscale,
  returns it. Any other call runs Megatron's function (and so the one-tensor rule).
Everything is matched by identity, so a call the scope did not foresee cannot get a wrong tensor.
"""
from __future__ import annotations

import functools
import inspect
import threading

from npuspeed.ops import fused_choice, rope
from npuspeed.patching.wrappers import followed_by

ATTENTION = "megatron.core.transformer.attention"
FORWARD = f"{ATTENTION}.Attention.forward"
QKV = f"{ATTENTION}.SelfAttention.get_query_key_value_tensors"
APPLY = "megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb"
#: Attention.forward's RoPE calls (query then key, `apply_rotary_pos_emb(t, freqs, config,
#: cu_seqlens, [mscale, cp_group])`) are checked against these releases (0.19 adds
#: `apply_rotary_pos_emb(..., mla_rotary_interleaved=False)` and Attention.forward's
#: `rotary_pos_cos_sin`; the calls themselves are unchanged)
MEGATRON_RANGE = ">=0.12,<0.20"

_LOCAL = threading.local()  # .scope: the _Scope of the Attention.forward running on this thread
_ORIGINAL: dict = {}  # "bshd": Megatron's _apply_rotary_pos_emb_bshd, "mla": its MLA keyword (rope.py)


class _Scope:
    __slots__ = ("module", "freqs", "query", "key", "key_version", "key_out", "mscale")

    def __init__(self, module, freqs):
        self.module, self.freqs = module, freqs
        self.query = self.key = self.key_out = self.key_version = self.mscale = None


def _shared_freqs(module, bound: dict):
    """The one angle tensor q and k get in this forward call, or None if the pair is not ours."""
    config = module.config
    emb = bound.get("rotary_pos_emb")
    if isinstance(emb, tuple):
        emb = emb[0] if len(emb) == 2 and emb[0] is emb[1] else None
    if emb is None or not fused_choice.triton_takes(emb):
        return None
    if any(bound.get(name) is not None for name in ("key_value_states", "inference_context", "inference_params",
                                                    "packed_seq_params", "rotary_pos_cos", "rotary_pos_sin",
                                                    "rotary_pos_cos_sin")):
        return None
    if any(getattr(config, name, False) for name in ("flash_decode", "apply_rope_fusion", "multi_latent_attention",
                                                     "fused_single_qkv_rope")):
        return None
    return emb


def forward_wrapper(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs).arguments
        except TypeError:
            return original(self, *args, **kwargs)
        freqs = _shared_freqs(self, bound)
        if freqs is None:
            return original(self, *args, **kwargs)
        outer = getattr(_LOCAL, "scope", None)
        _LOCAL.scope = _Scope(self, freqs)
        try:
            return original(self, *args, **kwargs)
        finally:
            _LOCAL.scope = outer

    return forward


def _keep_qk(attention, out) -> None:
    """After get_query_key_value_tensors: the open scope of this attention keeps its q and k."""
    scope = getattr(_LOCAL, "scope", None)
    if scope is not None and scope.module is attention and isinstance(out, tuple) and len(out) >= 3:
        scope.query, scope.key = out[0], out[1]  # (q, k, v[, gate]); a fused mixed_qkv is not ours


qkv_wrapper = followed_by(_keep_qk)


def apply_wrapper(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def apply_rotary_pos_emb(*args, **kwargs):
        scope = getattr(_LOCAL, "scope", None)
        if scope is None or (scope.query is None and scope.key_out is None):
            return original(*args, **kwargs)
        a = signature.bind(*args, **kwargs).arguments
        t, freqs, mscale = a.get("t"), a.get("freqs"), float(a.get("mscale", 1.0))
        if scope.key_out is not None:  # the key's call: its result is kept from the query's
            out, scope.key_out = scope.key_out, None
            if t is scope.key and freqs is scope.freqs and t._version == scope.key_version and mscale == scope.mscale:
                return out
            return original(*args, **kwargs)
        query, key, scope.query = scope.query, scope.key, None
        if (t is not query or freqs is not scope.freqs or key is None or a.get("cu_seqlens") is not None
                or a.get("mla_rotary_interleaved")):
            return original(*args, **kwargs)
        config = a["config"]
        interleaved = bool(getattr(config, "rotary_interleaved", False))
        bshd, mla = _ORIGINAL.get("bshd"), _ORIGINAL.get("mla")
        if bshd is None or mla is None:
            return original(*args, **kwargs)
        pair = rope.fused_rotary_pos_emb_qk(
            t, key, freqs, interleaved, mscale,
            lambda x: bshd(x, freqs, rotary_interleaved=interleaved, mscale=mscale, **{mla: False}))
        if pair is None:
            return original(*args, **kwargs)
        scope.key, scope.key_out, scope.key_version, scope.mscale = key, pair[1], key._version, mscale
        return pair[0]

    return apply_rotary_pos_emb

