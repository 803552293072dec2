"""The Ascend kernel: `torch_npu.npu_fusion_attention`, called by npuspeed.ops.npu.attention.

Megatron's [s, b, h, d] is the op's "SBH" layout after a free reshape, so nothing is
transposed. `head_num` is the query heads; K/V with fewer heads are GQA, which the op takes
natively. Masks use the op's polarity, which is Megatron's (True = masked out). Causal uses
the compressed 2048 x 2048 mask with sparse_mode 2, a band (window or --pre/--next-tockens)
the same mask with sparse_mode 4, an explicit mask a full boolean tensor with sparse_mode 0;
`--sparse-mode` forces a mode, and a mode that cannot express the pattern is an error.
"""
from __future__ import annotations

import functools

import torch

from npuspeed.features.base import FeatureError
from npuspeed.features.fused_attention.masks import UNBOUNDED, MaskPlan, band_keep, fix_dead_rows
from npuspeed.ops.npu.attention import sbh

COMPRESSED_SIZE = 2048  # the op's optimised causal mask for sparse_mode 2, 3, 4


@functools.lru_cache(maxsize=4)
def compressed_causal_mask(device: torch.device) -> torch.Tensor:
    return torch.ones(COMPRESSED_SIZE, COMPRESSED_SIZE, dtype=torch.bool, device=device).triu_(1)


def _full_mask(plan: MaskPlan, b: int, sq: int, sk: int, hq: int, device) -> torch.Tensor:
    """The pattern as one boolean tensor of a shape the op documents ("输入shape类型支持BNSS格式、
    B1SS格式、11SS格式、SS格式"): a per-head mask shared by the batch (1NSS, not listed) is
    expanded to BNSS."""
    if plan.causal:
        return torch.ones(sq, sk, dtype=torch.bool, device=device).triu_(1)[None, None]
    if plan.band is not None:
        return (~band_keep(sq, sk, plan.band, device))[None, None]
    mask = plan.mask
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.shape[1] not in (1, hq):
        raise FeatureError(
            f"--use-flash-attn: attention_mask has {mask.shape[1]} heads, the layer {hq}; "
            "npu_fusion_attention takes a mask with 1 or all heads"
        )
    batch = b if mask.shape[1] > 1 else mask.shape[0]
    return mask.expand(batch, mask.shape[1], sq, sk).contiguous()


def mask_arguments(plan: MaskPlan, sparse_mode: int | None, sq: int, sk: int, hq: int, device, b: int) -> dict:
    """atten_mask, sparse_mode, pre_tockens, next_tockens for the op (see module docstring)."""
    kind = "causal" if plan.causal else "band" if plan.band is not None else "mask" if plan.mask is not None else "none"
    left, right = plan.band if plan.band is not None else (UNBOUNDED, 0 if plan.causal else UNBOUNDED)
    args = {"atten_mask": None, "sparse_mode": 0, "pre_tockens": UNBOUNDED, "next_tockens": UNBOUNDED}
    if sparse_mode is None:  # auto: the cheapest form
        if kind in ("causal", "band"):
            args.update(atten_mask=compressed_causal_mask(device), sparse_mode=2 if kind == "causal" else 4)
            if kind == "band":
                args.update(pre_tockens=left, next_tockens=right)
        elif kind == "mask":
            args["atten_mask"] = _full_mask(plan, b, sq, sk, hq, device)
        return args
    fits = {
        0: ("none", "causal", "band", "mask"),
        1: ("causal", "band", "mask"),
        2: ("causal",),
        3: ("causal",),
        4: ("causal", "band"),
    }[sparse_mode]
    if kind not in fits:
        raise FeatureError(
            f"--sparse-mode {sparse_mode} cannot express this layer's attention pattern ({kind}); "
            f"it fits {', '.join(fits)}. Leave --sparse-mode out to let npuspeed choose."
        )
    args["sparse_mode"] = sparse_mode
    if sparse_mode in (2, 3, 4):
        args["atten_mask"] = compressed_causal_mask(device)
        if sparse_mode == 4:
            args.update(pre_tockens=left, next_tockens=right)
    elif kind != "none":
        args["atten_mask"] = _full_mask(plan, b, sq, sk, hq, device)
        if sparse_mode == 0 and kind in ("causal", "band"):
            # mode 0 aligns its band at the top-left corner, ours at the bottom-right
            shift = sk - sq
            args.update(pre_tockens=min(UNBOUNDED, left - shift), next_tockens=min(UNBOUNDED, right + shift))
            _check_negative_tockens(args["pre_tockens"], args["next_tockens"], sq, sk)
    return args


def _check_negative_tockens(pre: int, nxt: int, sq: int, sk: int) -> None:
    """npu_fusion_attention's sparse_mode 0 takes a negative pre_tockens only with next_tockens
    >= |pre_tockens| and |pre_tockens| < Sq, a negative next_tockens only with pre_tockens >=
    |next_tockens| and |next_tockens| < Skv (its documented constraints)."""
    bad = (pre < 0 and not (nxt >= -pre and -pre < sq)) or (nxt < 0 and not (pre >= -nxt and -nxt < sk))
    if bad:
        raise FeatureError(
            f"--sparse-mode 0: this layer's band at Sq={sq}, Skv={sk} needs pre_tockens={pre}, "
            f"next_tockens={nxt}, outside what npu_fusion_attention takes in mode 0 (a negative one needs "
            "the other at least its size and itself within the sequence). Leave --sparse-mode out "
            "(mode 4 aligns the band at the bottom-right corner).")


def npu_attention(
    lib,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: MaskPlan,
    *,
    scale: float,
    dropout_p: float,
    sparse_mode: int | None,
) -> torch.Tensor:
    """query [sq, b, hq, d], key/value [sk, b, hk, d] -> context [sq, b, hq * d]; `lib` the op
    library (npuspeed.ops.npu.library: None is the loaded torch_npu, a test passes a stand-in)."""
    sq, b, hq, d = query.shape
    sk, hk = key.shape[0], key.shape[2]
    mask_args = mask_arguments(plan, sparse_mode, sq, sk, hq, query.device, b)
    outputs = sbh(lib, query.reshape(sq, b, hq * d), key.reshape(sk, b, hk * d), value.reshape(sk, b, hk * d),
                  hq, scale=scale, keep_prob=1.0 - dropout_p, mask_args=mask_args)
    out = outputs[0]  # (attention_out, softmax_max, softmax_sum, softmax_in, seed, offset, numels)
    if plan.dead_rows is not None:
        bhsd = out.view(sq, b, hq, d).permute(1, 2, 0, 3)
        bhsd = fix_dead_rows(bhsd, value.permute(1, 2, 0, 3), plan.dead_rows)
        out = bhsd.permute(2, 0, 1, 3).reshape(sq, b, hq * d)
    return out
