"""Test inputs in npu_fusion_attention's layouts, from [B, N, S, D]."""
from __future__ import annotations


def to_layout(x, layout):
    b, n, s, d = x.shape
    return {"BNSD": x, "BSND": x.permute(0, 2, 1, 3), "BSH": x.permute(0, 2, 1, 3).reshape(b, s, n * d),
            "SBH": x.permute(2, 0, 1, 3).reshape(s, b, n * d)}[layout].contiguous()
