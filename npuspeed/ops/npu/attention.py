"""torch_npu's fused attention in the SBH layout (the TND/varlen calls are varlen.py's).

`sbh` serves --use-flash-attn and context parallelism's blocks; `sbh_grad` is the blocks'
backward from the final output and LSE. `lib`: the op library (`library`: None is torch_npu).
"""
from __future__ import annotations

import torch

from npuspeed.ops.npu import library


def sbh(lib, query, key, value, head_num: int, *, scale: float, keep_prob: float, mask_args: dict):
    """npu_fusion_attention on [s, b, h * d] tensors: its 7 outputs (attention_out, softmax_max,
    softmax_sum, softmax_in, seed, offset, numels)."""
    return library(lib).npu_fusion_attention(query, key, value, head_num, "SBH", scale=scale,
                                             keep_prob=keep_prob, **mask_args)


def sbh_grad(lib, query, key, value, dout, head_num: int, *, softmax_max, attention_in, scale: float,
             keep_prob: float, extra: dict):
    """npu_fusion_attention_grad with the final LSE as softmax_max and ones as softmax_sum (the
    op recomputes P = exp(s - lse)); `extra`: mask arguments and the forward's dropout state."""
    return library(lib).npu_fusion_attention_grad(
        query, key, value, dout, head_num, "SBH", softmax_max=softmax_max,
        softmax_sum=torch.ones_like(softmax_max), attention_in=attention_in, scale_value=scale,
        keep_prob=keep_prob, **extra)
