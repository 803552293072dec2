"""Megatron's mask plan as the CPU kernels' per-row key ranges, and the kernel call itself.

The kernels take causal plus one key interval per (batch, query row) (see
npuspeed/ops/attention_bounds.py). Causal and no-mask calls need no tensor at all; bands
become ranges arithmetically; an explicit mask is read once (O(b x S^2), as Megatron reads it
in its softmax) and, when every row's allowed keys are one interval (key padding, causal |
padding, block-diagonal documents), becomes ranges; the result is cached per mask object, so
the layers of a step that share one mask read it once. Rows that Megatron masks entirely get
its uniform-attention output, the mean of V (as masks.py explains).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from npuspeed.features.attention.dropout import draw_seed_offset, global_head0
from npuspeed.ops import attention_bounds
from npuspeed.ops import flash_attention as cpu_flash


@dataclass
class KernelRows:
    causal: bool = False
    key_lo: torch.Tensor | None = None
    key_hi: torch.Tensor | None = None
    dead: torch.Tensor | None = None  # [b, sq] bool: rows Megatron masks entirely
    source: str = "no mask"


_CACHE: dict = {"ref": None, "key": None, "rows": None}


def _from_mask(plan, attention_mask, b: int, sq: int, sk: int) -> KernelRows | None:
    key = (getattr(attention_mask, "_version", None), plan.source, tuple(plan.mask.shape), b)
    ref = _CACHE["ref"]
    if ref is not None and ref() is attention_mask and _CACHE["key"] == key:
        return _CACHE["rows"]
    mask = plan.mask
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 4 else mask
    found = attention_bounds.mask_to_bounds(mask, sq, sk)
    rows = None
    if found is not None:
        lo, hi, _ = found
        dead = None
        if plan.dead_rows is not None and bool(plan.dead_rows.any()):
            d = plan.dead_rows.reshape(plan.dead_rows.shape[0], -1)  # [b or 1, sq or 1]
            dead = d.expand(b, sq)
        rows = KernelRows(False, lo.expand(b, sq), hi.expand(b, sq), dead, "mask as per-row key ranges")
    _CACHE.update(ref=weakref.ref(attention_mask) if attention_mask is not None else None, key=key, rows=rows)
    return rows


def kernel_rows(plan, attention_mask, b: int, sq: int, sk: int) -> KernelRows | None:
    """The plan as per-row key ranges, or None when it is not one (an arbitrary mask)."""
    if plan.mask is not None:
        return _from_mask(plan, attention_mask, b, sq, sk)
    if plan.band is not None:
        lo, hi = attention_bounds.from_band(b, sq, sk, plan.band)
        return KernelRows(False, lo, hi, None, f"band {plan.band} as per-row key ranges")
    return KernelRows(causal=plan.causal, source="causal" if plan.causal else "no mask")


def _mean_v_rows(out: torch.Tensor, value: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    """out [sq, b, hq, d] with dead rows ([b, sq]) replaced by the mean of V over all keys."""
    mean_v = value.mean(dim=0)  # [b, hk, d]
    groups = out.shape[2] // value.shape[2]
    if groups > 1:
        mean_v = mean_v.repeat_interleave(groups, dim=1)
    return torch.where(dead.t()[:, :, None, None], mean_v[None].to(out.dtype), out)


def cpu_flash_run(module, query, key, value, rows: KernelRows, *, scale: float, dropout_p: float,
                  upcast: bool = False):
    """npuspeed's CPU kernel on one call -> context [sq, b, hq * d]; draws the dropout seed
    from the generator in force (the tracker's fork), so run it inside that fork. `upcast`:
    bf16 inputs on the fp32 kernel (where the bf16 one is absent), O(S x d) copies."""
    if upcast:
        dtype = query.dtype
        context = cpu_flash_run(module, query.float(), key.float(), value.float(), rows, scale=scale,
                                dropout_p=dropout_p)
        return context.to(dtype)
    seed = offset = 0
    if dropout_p > 0.0:
        seed, offset = draw_seed_offset()
    params = cpu_flash.FlashParams(scale=scale, causal=rows.causal, dropout_p=dropout_p, seed=seed, offset=offset,
                                   head0=global_head0(module) if dropout_p > 0.0 else 0)
    out, _lse = cpu_flash.flash_attention_with_lse(query, key, value, params, rows.key_lo, rows.key_hi)
    if rows.dead is not None:
        out = _mean_v_rows(out, value, rows.dead)
    sq, b, hq, d = out.shape
    return out.reshape(sq, b, hq * d)
