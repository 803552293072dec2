"""Dropout inside npuspeed's CPU flash kernels (csrc/cpu/philox.h): the generator, the mask's
statistics and coordinates, and forward + backward against an explicit-mask reference that
uses the very mask the kernel draws (`dropout_mask`), for fp32 and bf16, GQA, causal, odd
lengths, key ranges and global positions."""
from __future__ import annotations

import math

import pytest
import torch

from npuspeed.ops import attention_bounds
from npuspeed.ops import flash_attention as fa

needs_fp32 = pytest.mark.skipif(fa.fp32_reason() is not None, reason=f"no fp32 kernel: {fa.fp32_reason()}")
needs_bf16 = pytest.mark.skipif(fa.machine_reason() is not None, reason=f"no bf16 kernel: {fa.machine_reason()}")


@needs_fp32
def test_philox_known_answers():
    """Random123's known-answer vectors for Philox4x32-10."""
    ops = torch.ops.npuspeed
    cases = [
        ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    ]
    for counter, key, expected in cases:
        assert [x & 0xFFFFFFFF for x in ops.philox4x32(counter, key)] == expected


@needs_fp32
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_kept_fraction_is_within_three_sigma(p):
    params = fa.FlashParams(scale=1.0, dropout_p=p, seed=20240601, offset=3)
    mask = fa.dropout_mask(2, 4, 250, 500, params)  # 10^6 elements
    n = mask.numel()
    kept = mask.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(kept - (1 - p)) <= 3 * sigma, f"kept {kept:.6f}, expected {1 - p} +- {3 * sigma:.2e}"


@needs_fp32
def test_mask_differs_across_heads_batches_seeds_and_offsets():
    base = fa.FlashParams(scale=1.0, dropout_p=0.3, seed=11, offset=5)
    m = fa.dropout_mask(2, 3, 64, 64, base)
    assert not torch.equal(m[0, 0], m[0, 1]) and not torch.equal(m[0, 0], m[1, 0])
    assert not torch.equal(m[0, 0, 0], m[0, 0, 1])  # rows differ
    for other in (fa.FlashParams(scale=1.0, dropout_p=0.3, seed=12, offset=5),
                  fa.FlashParams(scale=1.0, dropout_p=0.3, seed=11, offset=6)):
        assert (fa.dropout_mask(2, 3, 64, 64, other) != m).float().mean() > 0.2
    assert torch.equal(fa.dropout_mask(2, 3, 64, 64, base), m)  # a pure function


@needs_fp32
def test_mask_is_a_function_of_global_coordinates():
    """A window at (q_pos0, k_pos0) with heads from head0 is that slice of the whole mask: what
    context and tensor parallelism need to draw, per element, what one rank would."""
    whole = fa.dropout_mask(2, 6, 200, 300, fa.FlashParams(scale=1.0, dropout_p=0.2, seed=7, offset=1))
    part = fa.dropout_mask(2, 2, 77, 101, fa.FlashParams(scale=1.0, dropout_p=0.2, seed=7, offset=1,
                                                          q_pos0=61, k_pos0=93, head0=3))
    assert torch.equal(part, whole[:, 3:5, 61:138, 93:194])


def reference(q, k, v, scale, causal, keep, p, key_lo=None, key_hi=None, q_pos0=0, k_pos0=0):
    """fp64 attention with an explicit mask and the kernel's dropout mask; [s, b, h, d] in."""
    qq, kk, vv = (t.permute(1, 2, 0, 3).double() for t in (q, k, v))
    group = qq.shape[1] // kk.shape[1]
    kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
    s = qq @ kk.transpose(-1, -2) * scale
    sq, sk = s.shape[-2:]
    qi = torch.arange(sq)[:, None] + q_pos0
    kj = torch.arange(sk)[None, :] + k_pos0
    allowed = torch.ones(sq, sk, dtype=torch.bool)[None, None]
    if causal:
        allowed = allowed & (kj <= qi)
    if key_lo is not None:
        allowed = allowed & (kj[None] >= key_lo[:, :, None].long())[:, None]
    if key_hi is not None:
        allowed = allowed & (kj[None] < key_hi[:, :, None].long())[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    probs = torch.softmax(s, -1).nan_to_num(0.0)
    if keep is not None:
        probs = probs * keep / (1 - p)
    return (probs @ vv).permute(2, 0, 1, 3), lse


CASES = [  # sq, sk, b, hq, hk, d, causal, p, positions
    (37, 37, 2, 4, 2, 16, True, 0.1, (0, 0)),     # odd, GQA 2:1
    (130, 130, 1, 2, 1, 32, True, 0.3, (0, 0)),   # past two tiles, GQA 2:1
    (70, 130, 2, 2, 2, 16, False, 0.2, (0, 0)),   # unmasked, sq != sk
    (65, 90, 1, 2, 1, 16, True, 0.1, (100, 75)),  # a chunk of a longer sequence (ring attention)
    (50, 50, 2, 2, 2, 16, True, 0.0, (0, 0)),     # no dropout
    (96, 96, 1, 4, 1, 64, True, 0.1, (0, 0)),     # GQA 4:1, d = 64 (the e2e benchmark's heads)
]


def _inputs(sq, sk, b, hq, hk, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, hq, d, generator=gen).to(dtype)
    k = torch.randn(sk, b, hk, d, generator=gen).to(dtype)
    v = torch.randn(sk, b, hk, d, generator=gen).to(dtype)
    g = torch.randn(sq, b, hq, d, generator=gen).to(dtype)
    return q, k, v, g


def _check(dtype, sq, sk, b, hq, hk, d, causal, p, positions, bounds=None, tol=None):
    q, k, v, g = _inputs(sq, sk, b, hq, hk, d, dtype)
    scale = d ** -0.5
    params = fa.FlashParams(scale=scale, causal=causal, dropout_p=p, seed=99, offset=4,
                            q_pos0=positions[0], k_pos0=positions[1])
    key_lo, key_hi = bounds or (None, None)
    keep = fa.dropout_mask(b, hq, sq, sk, params).double() if p else None
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = fa.flash_attention_with_lse(*leaves, params, key_lo, key_hi)
    out.backward(g)
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref, ref_lse = reference(*ref_leaves, scale, causal, keep, p, key_lo, key_hi, *positions)
    ref.backward(g.double())
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), live)
    assert (lse[live].double() - ref_lse[live]).abs().max() < (1e-4 if dtype == torch.float32 else 2e-2)
    for name, a, r in zip(("out", "dq", "dk", "dv"), [out] + [t.grad for t in leaves],
                          [ref] + [t.grad for t in ref_leaves]):
        err = ((a.double() - r).norm() / r.norm().clamp_min(1e-12)).item()
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"


@needs_fp32
@pytest.mark.parametrize("sq,sk,b,hq,hk,d,causal,p,positions", CASES)
def test_fp32_matches_explicit_mask_reference(sq, sk, b, hq, hk, d, causal, p, positions):
    _check(torch.float32, sq, sk, b, hq, hk, d, causal, p, positions, tol=2e-5)


@needs_bf16
@pytest.mark.parametrize("sq,sk,b,hq,hk,d,causal,p,positions", CASES)
def test_bf16_matches_explicit_mask_reference(sq, sk, b, hq, hk, d, causal, p, positions):
    _check(torch.bfloat16, sq, sk, b, hq, hk, d, causal, p, positions, tol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_key_ranges_padding_and_documents(dtype):
    if (fa.fp32_reason() if dtype == torch.float32 else fa.machine_reason()):
        pytest.skip("kernel unavailable here")
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    lengths = torch.tensor([90, 33])
    _check(dtype, 90, 90, 2, 2, 1, 16, True, 0.1, (0, 0), bounds=attention_bounds.from_lengths(lengths, 90), tol=tol)
    cu = torch.tensor([[0, 20, 75, 100], [0, 64, 65, 100]])
    _check(dtype, 100, 100, 2, 2, 2, 16, True, 0.2, (0, 0), bounds=attention_bounds.from_cu_seqlens(cu, 100),
           tol=tol)


@needs_fp32
def test_rows_without_keys_give_zero_and_minus_inf_lse():
    q, k, v, _ = _inputs(40, 40, 1, 2, 2, 16, torch.float32)
    # the query chunk [0, 40) against keys at global positions [100, 140), causal: nothing visible
    params = fa.FlashParams(scale=0.25, causal=True, k_pos0=100)
    out, lse = fa.forward(q, k, v, params)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dropout_is_the_same_at_any_thread_count(dtype):
    if (fa.fp32_reason() if dtype == torch.float32 else fa.machine_reason()):
        pytest.skip("kernel unavailable here")
    q, k, v, g = _inputs(150, 150, 2, 4, 2, 32, dtype, seed=5)
    params = fa.FlashParams(scale=0.2, causal=True, dropout_p=0.1, seed=3, offset=9)
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out, _ = fa.flash_attention_with_lse(*leaves, params)
            out.backward(g)
            results.append([out.detach()] + [t.grad for t in leaves])
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_documents_equal_each_document_alone(dtype):
    """Documents packed in one row (cu_seqlens) == each document run alone at its global
    position (q_pos0 = k_pos0 = its start), dropout included: outputs and gradients."""
    if (fa.fp32_reason() if dtype == torch.float32 else fa.machine_reason()):
        pytest.skip("kernel unavailable here")
    s, cu = 200, [0, 37, 130, 131, 200]
    q, k, v, g = _inputs(s, s, 1, 4, 2, 32, dtype, seed=8)
    lo, hi = attention_bounds.from_cu_seqlens(torch.tensor(cu), s)
    params = fa.FlashParams(scale=0.2, causal=True, dropout_p=0.15, seed=5, offset=77)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    packed, _ = fa.flash_attention_with_lse(*leaves, params, lo, hi)
    packed.backward(g)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, z in zip(cu[:-1], cu[1:]):
        part = [t[a:z].clone().requires_grad_(True) for t in (q, k, v)]
        alone, _ = fa.flash_attention_with_lse(*part, fa.FlashParams(
            scale=0.2, causal=True, dropout_p=0.15, seed=5, offset=77, q_pos0=a, k_pos0=a))
        alone.backward(g[a:z])
        for x, y in [(packed[a:z], alone)] + [(full.grad[a:z], p.grad) for full, p in zip(leaves, part)]:
            assert (x.float() - y.float()).abs().max().item() <= tol * max(1.0, y.float().abs().max().item())
