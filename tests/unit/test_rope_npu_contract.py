"""--use-fused-rotary-pos-emb's NPU candidate keeps torch_npu's npu_rotary_mul contract (half
mode, documentation of torch_npu 2.6.0-2.14.0): "r1: 数据范围：[-1, 1]" (cos and sin in [-1, 1],
so YaRN's mscale is applied to the op's output, not folded into cos/sin), and "D < 896，且为2的倍数;
B, N < 1000" with cos/sin of layout S11D, SB1D or SBND for an SBND input, dtype float16, bfloat16
or float32. Where a limit fails the op is not a candidate (the others run).

The NPU is simulated: a fake torch_npu records each call's breaches of those rules and computes
the documented half-mode formula on the CPU; the dispatcher answers "npu" for CPU tensors."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from npuspeed.ops import _dispatch, rope


def _breaches(x, r1, r2):
    s, b, n, d = x.shape
    out = [] if d < 896 and d % 2 == 0 and b < 1000 and n < 1000 else ["input shape"]
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        out.append("dtype")
    for r in (r1, r2):
        if r.abs().max() > 1:
            out.append("cos/sin outside [-1, 1]")
        if r.shape[0] != s or r.shape[3] != d or (r.shape[1], r.shape[2]) not in {(1, 1), (b, 1), (b, n)}:
            out.append("cos/sin layout")
    return out


@pytest.fixture
def npu(monkeypatch):
    calls = []

    def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
        calls.append(_breaches(x, r1, r2))
        x1, x2 = torch.chunk(x, 2, -1)
        return r1 * x + r2 * torch.cat((-x2, x1), dim=-1)

    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu_rotary_mul=npu_rotary_mul))
    monkeypatch.setattr(_dispatch, "implementation", lambda op, *tensors: "npu")
    rope._TABLES.clear()
    return calls


def _inputs(s=6, b=2, n=3, d=8, rot=8, freqs_shape=None, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(s, b, n, d, generator=gen).to(dtype)
    freqs = torch.rand(*(freqs_shape or (s, 1, 1, rot)), generator=gen) * 6
    return t, freqs


def test_mscale_is_applied_outside_the_op(npu):
    t, freqs = _inputs(d=10, rot=8)
    out = rope.rotary_pos_emb(t, freqs, mscale=1.7)
    assert npu == [[]]  # called once, inside the documented contract
    torch.testing.assert_close(out, rope.rotary_pos_emb_reference(t, freqs, mscale=1.7))
    assert "npu" in rope.candidates(t, freqs, False, 1.7, megatron=lambda t: t)


@pytest.mark.parametrize("case", [
    dict(d=896, rot=896), dict(n=1000, d=2, rot=2, s=1, b=1), dict(freqs_shape=(1, 1, 1, 8)),
    dict(freqs_shape=(6, 1, 3, 8)), dict(dtype=torch.float64)])
def test_outside_the_documented_limits_the_op_is_no_candidate(npu, case):
    t, freqs = _inputs(**case)
    assert set(rope.candidates(t, freqs, False, 1.0, megatron=lambda t: t)) <= {"megatron", "triton"}
    out = rope.rotary_pos_emb(t, freqs)
    assert npu == []
    torch.testing.assert_close(out, rope.rotary_pos_emb_reference(t, freqs))
