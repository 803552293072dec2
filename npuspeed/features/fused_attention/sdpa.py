"""The CPU / CUDA kernel: `torch.nn.functional.scaled_dot_product_attention`.

Megatron hands [s, b, h, d]; SDPA wants [b, h, s, d]. A permute is a view, so nothing is
copied on the way in; the output is reshaped back to Megatron's [s, b, h*d]. Causal runs
with `is_causal` (no S x S tensor), GQA with `enable_gqa` (K/V are not repeated), a band
(window or --pre/--next-tockens) with one [sq, sk] boolean mask built only then, and an
explicit mask with its polarity flipped (SDPA: True = attend).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from npuspeed.accelerator.devices import for_device
from npuspeed.features.fused_attention.masks import MaskPlan, band_keep, fix_dead_rows

# A builtin has no inspectable signature; its docstring states the parameters (torch >= 2.5).
HAS_ENABLE_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "").split("->")[0]


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: MaskPlan,
    *,
    scale: float,
    dropout_p: float,
) -> torch.Tensor:
    """query [sq, b, hq, d], key/value [sk, b, hk, d] -> context [sq, b, hq * d]."""
    sq, b, hq, d = query.shape
    sk, hk = key.shape[0], key.shape[2]
    q = query.permute(1, 2, 0, 3)
    k = key.permute(1, 2, 0, 3)
    v = value.permute(1, 2, 0, 3)
    kwargs = {"scale": scale, "dropout_p": dropout_p}
    if hq != hk:
        if HAS_ENABLE_GQA:
            kwargs["enable_gqa"] = True
        else:  # older torch: repeat as Megatron does
            k = k.repeat_interleave(hq // hk, dim=1)
            v = v.repeat_interleave(hq // hk, dim=1)
    if plan.causal:
        kwargs["is_causal"] = True
    elif plan.band is not None:
        kwargs["attn_mask"] = band_keep(sq, sk, plan.band, query.device)
    elif plan.mask is not None:
        kwargs["attn_mask"] = ~plan.mask
    with _deterministic_backends(query.device):
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)  # [b, hq, sq, d]
    if plan.dead_rows is not None:
        out = fix_dead_rows(out, v, plan.dead_rows)
    return out.permute(2, 0, 1, 3).reshape(sq, b, hq * d)


def _deterministic_backends(device: torch.device):
    """Under --deterministic-mode on CUDA, only SDPA kernels whose backward is deterministic:
    flash (torch runs its deterministic backward then) and math; the memory-efficient and
    cuDNN kernels accumulate dQ with atomics."""
    if not for_device(device).has_sdpa_kernels() or not torch.are_deterministic_algorithms_enabled():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
