"""npuspeed's bf16 CPU flash attention kernel (csrc/x86/flash_attention_bf16.cpp).

Against fp32 attention on the same bf16 inputs: output and all three gradients must be as
close as PyTorch's own bf16 kernel gets (its rms error, +10%; its largest error within one
more bf16 rounding), across GQA, partial
tiles, non-causal sq != sk, head dims and strided [s, b, h, d] views. Also: thread-count
invariance, and the choice of kernel inside --use-flash-attn (what runs it, what does not).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from npuspeed.ops import flash_attention as cpu_flash

needs_kernel = pytest.mark.skipif(cpu_flash.machine_reason() is not None,
                                  reason=f"kernel unavailable here: {cpu_flash.machine_reason()}")


def attention_fp32(q, k, v, scale, causal):
    qq, kk, vv = (t.permute(1, 2, 0, 3).float() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=scale, enable_gqa=True)
    return out.permute(2, 0, 1, 3)


def sdpa_bf16(q, k, v, scale, causal):
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=scale, enable_gqa=True)
    return out.permute(2, 0, 1, 3)


def grads(fn, q, k, v, grad, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves, **kw)
    out.reshape(grad.shape).backward(grad.to(out.dtype))
    return [out.detach().reshape(grad.shape)] + [t.grad for t in leaves]


def inputs(sq, sk, b, hq, hk, d, seed=0, strided=False):
    gen = torch.Generator().manual_seed(seed)
    if strided:  # q, k, v as views of one fused projection, as Megatron's QKV split gives them
        mixed = torch.randn(sq, b, hq + 2 * hk, d, generator=gen).bfloat16()
        q, k, v = torch.split(mixed, [hq, hk, hk], dim=2)
    else:
        q = torch.randn(sq, b, hq, d, generator=gen).bfloat16()
        k = torch.randn(sk, b, hk, d, generator=gen).bfloat16()
        v = torch.randn(sk, b, hk, d, generator=gen).bfloat16()
    grad = torch.randn(sq, b, hq, d, generator=gen).bfloat16()
    return q, k, v, grad


CASES = [  # sq, sk, b, hq, hk, d, causal, strided
    (128, 128, 1, 4, 1, 64, True, False),   # whole tiles, GQA 4:1
    (100, 100, 2, 4, 2, 64, True, False),   # partial tile, batch 2
    (257, 257, 1, 2, 2, 128, True, True),   # one row past a tile, strided views
    (70, 130, 1, 2, 1, 32, False, False),   # unmasked, sq != sk
    (64, 64, 3, 1, 1, 16, False, True),
]


@needs_kernel
@pytest.mark.parametrize("sq,sk,b,hq,hk,d,causal,strided", CASES)
def test_matches_fp32_as_closely_as_sdpa(sq, sk, b, hq, hk, d, causal, strided):
    q, k, v, grad = inputs(sq, sk, b, hq, hk, d, strided=strided)
    scale = d ** -0.5
    ref = grads(attention_fp32, q, k, v, grad, scale=scale, causal=causal)
    ours = grads(lambda *t, **kw: cpu_flash.flash_attention(*t, **kw), q, k, v, grad.reshape(sq, b, hq * d),
                 scale=scale, causal=causal)
    theirs = grads(sdpa_bf16, q, k, v, grad, scale=scale, causal=causal)
    for name, r, o, t in zip(("out", "dq", "dk", "dv"), ref, ours, theirs):
        o = o.reshape(r.shape)
        assert o.dtype == torch.bfloat16
        rms = (o.float() - r).pow(2).mean().sqrt().item() / r.pow(2).mean().sqrt().item()
        sdpa_rms = (t.float() - r).pow(2).mean().sqrt().item() / r.pow(2).mean().sqrt().item()
        assert rms <= 1.1 * sdpa_rms + 2e-4, f"{name}: relative rms error {rms:.2e} vs SDPA's {sdpa_rms:.2e}"
        # The largest element error is one bf16 rounding either way (2^-8 of the value).
        worst = ((o.float() - r).abs().max() / r.abs().max()).item()
        sdpa_worst = ((t.float() - r).abs().max() / r.abs().max()).item()
        assert worst <= 2 * sdpa_worst + 2e-3, f"{name}: max error {worst:.2e} vs SDPA's {sdpa_worst:.2e}"


@needs_kernel
def test_causal_ignores_later_keys():
    q, k, v, grad = inputs(96, 96, 1, 2, 1, 32, seed=3)
    k2, v2 = k.clone(), v.clone()
    k2[80:], v2[80:] = 7.0, -7.0  # keys/values only positions >= 80 may see
    a = cpu_flash.flash_attention(q, k, v, scale=0.2, causal=True).view(96, 1, 2, 32)
    b = cpu_flash.flash_attention(q, k2, v2, scale=0.2, causal=True).view(96, 1, 2, 32)
    assert torch.equal(a[:80], b[:80])
    assert not torch.equal(a[80:], b[80:])


@needs_kernel
def test_same_bits_at_any_thread_count():
    q, k, v, grad = inputs(200, 200, 2, 4, 2, 64, seed=4)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(grads(lambda *t, **kw: cpu_flash.flash_attention(*t, **kw), q, k, v,
                                 grad.reshape(200, 2, 256), scale=0.125, causal=True))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_unsupported_calls_name_their_reason(monkeypatch):
    monkeypatch.setattr(cpu_flash, "machine_reason", lambda: None)
    monkeypatch.setattr(cpu_flash, "fp32_reason", lambda: None)
    q = torch.randn(32, 1, 2, 16)
    qb = q.bfloat16()

    def why(t, **kw):
        args = dict(masked=False, dropout_p=0.0) | kw
        return cpu_flash.unsupported(t, t, **args)

    assert why(qb) is None and why(q) is None  # bf16 and fp32 kernels
    assert why(qb, dropout_p=0.1) is None  # dropout runs inside the kernels
    assert "bf16 or fp32" in why(q.half())
    assert "per-row key ranges" in why(qb, masked=True)
    assert "multiple of 16" in why(torch.randn(32, 1, 2, 24).bfloat16())
    assert why(torch.randn(32, 1, 2, 24)) is None  # the fp32 kernel takes any head dim
    monkeypatch.setattr(cpu_flash, "machine_reason", lambda: "this CPU lacks AVX512-BF16")
    assert why(qb) == "this CPU lacks AVX512-BF16" and why(q) is None
    with pytest.raises(ValueError, match="cannot run this call: this CPU lacks"):
        cpu_flash.flash_attention(qb, qb, qb, scale=0.25, causal=True)


def test_report_row_says_which_kernel(monkeypatch):
    from npuspeed.ops import catalog

    row = next(r for r in catalog() if r["name"] == "flash_attention")
    reason = cpu_flash.machine_reason()
    assert ("AVX512-BF16" in row["implementation"]) if reason is None else (reason in row["implementation"])
    monkeypatch.setattr(cpu_flash, "machine_reason", lambda: "this CPU lacks AVX512-BF16")
    row = next(r for r in catalog() if r["name"] == "flash_attention")
    assert row["implementation"].startswith("scaled_dot_product_attention or Megatron's unfused path, measured "
                                            "(npuspeed's kernel unavailable: this CPU")
