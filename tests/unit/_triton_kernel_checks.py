"""npuspeed's Triton kernels (npuspeed/ops/triton/) against the pure-PyTorch references,
forward and backward (every input's gradient, the norm weight's included), fp32 and bf16,
odd widths and a few rows, on CPU through Triton's interpreter.

Run by tests/unit/test_triton_kernels.py in a fresh process with TRITON_INTERPRET=1: the
interpreter needs the flag before triton is first imported (triton.language's own jitted
helpers such as tl.sum are wrapped at that import), and in the suite's process another
test may have imported triton already. Runnable alone too: `pytest tests/unit/_triton_kernel_checks.py`.
Small block caps are patched in where a test needs several column / head blocks or several
rows per backward program at a small shape.
"""
from __future__ import annotations

import os
import sys

import pytest

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (run via test_triton_kernels.py)",
                allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (pip install -e .[test] on Linux x86_64)")

import torch  # noqa: E402

from npuspeed.ops.moe_permute import permute_reference, unpermute_reference  # noqa: E402
from npuspeed.ops.rms_norm import rms_norm_reference  # noqa: E402
from npuspeed.ops.rope import rotary_pos_emb_reference  # noqa: E402
from npuspeed.ops.swiglu import swiglu_reference  # noqa: E402
from npuspeed.ops.triton import _runtime  # noqa: E402
from npuspeed.ops.triton import moe_permute as tmoe  # noqa: E402
from npuspeed.ops.triton import rms_norm as trms  # noqa: E402
from npuspeed.ops.triton import rope as trope  # noqa: E402
from npuspeed.ops.triton import swiglu as tswiglu  # noqa: E402
from triton_masks import boolean_masks_only  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _boolean_masks():
    """Each kernel's masks boolean, as triton 3.9's interpreter requires (older ones let it pass)."""
    with boolean_masks_only():
        yield


def _close(got, want, dtype, scale=1.0):
    if dtype == torch.float32:
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-5 * scale)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=3e-2 * scale)


def _leaf(t):
    return t.detach().clone().requires_grad_(t.requires_grad)


def test_available_under_the_interpreter_and_a_clear_error_without(monkeypatch):
    assert trms.available() and tswiglu.available() and trope.available() and tmoe.available()
    monkeypatch.delenv("TRITON_INTERPRET")
    if _runtime.device_type() is None:
        assert not trms.available()
    with pytest.raises(RuntimeError, match="Triton cannot run on"):
        tswiglu.swiglu(torch.randn(2, 6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 37), (2, 100)])
def test_rms_norm_matches_reference(dtype, shape, monkeypatch):
    monkeypatch.setattr(trms, "PARTIAL_PROGRAMS", 4)  # several rows per backward program, the last one partial
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype).requires_grad_()
    xr, wr = _leaf(x), _leaf(w)
    y = trms.rms_norm(x, w, 1e-5)
    yr = rms_norm_reference(xr, wr, 1e-5)
    assert y.dtype == yr.dtype and y.shape == yr.shape
    _close(y, yr, dtype)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    _close(x.grad, xr.grad, dtype)
    _close(w.grad, wr.grad, dtype, scale=x.numel() / shape[-1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_weight_and_with_an_fp32_weight(dtype):
    x = torch.randn(7, 33, dtype=dtype, requires_grad=True)
    xr = _leaf(x)
    y, yr = trms.rms_norm(x, None, 1e-6), rms_norm_reference(xr, None, 1e-6)
    _close(y, yr, dtype)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    _close(x.grad, xr.grad, dtype)
    w = torch.randn(33, requires_grad=True)  # fp32 weight: the output promotes, as torch.nn.RMSNorm
    wr = _leaf(w)
    y, yr = trms.rms_norm(x, w), rms_norm_reference(xr, wr, 1e-5)
    assert y.dtype == yr.dtype == torch.float32
    _close(y, yr, dtype)
    y.sum().backward()
    yr.sum().backward()
    _close(w.grad, wr.grad, dtype, scale=7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_with_the_residual_add(dtype):
    x = torch.randn(2, 3, 45, dtype=dtype, requires_grad=True)
    r = torch.randn(2, 3, 45, dtype=dtype, requires_grad=True)
    w = torch.randn(45, dtype=dtype, requires_grad=True)
    xr, rr, wr = _leaf(x), _leaf(r), _leaf(w)
    y, h = trms.rms_norm_residual(x, r, w, 1e-5)
    yr, hr = trms.rms_norm_residual_reference(xr, rr, wr, 1e-5)
    if dtype == torch.float32:
        assert torch.equal(h, hr)  # the add is rounded to the activation dtype once, as unfused
    _close(h, hr, dtype)  # (the interpreter's fp32 -> bf16 cast truncates; a GPU's rounds to nearest)
    _close(y, yr, dtype)
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    ((y * gy).sum() + (h * gh).sum()).backward()
    ((yr * gy).sum() + (hr * gh).sum()).backward()
    for got, want, scale in ((x.grad, xr.grad, 1), (r.grad, rr.grad, 1), (w.grad, wr.grad, 6)):
        _close(got, want, dtype, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 3, 90), (5, 2 * 45)])
def test_swiglu_matches_reference_and_megatrons_gate_half(dtype, shape, monkeypatch):
    from megatron.core.fusions.fused_bias_swiglu import swiglu as megatron_swiglu

    monkeypatch.setattr(tswiglu, "BLOCK_CAP", 16)  # three column blocks, the last one partial
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    xr = _leaf(x)
    y, yr = tswiglu.swiglu(x), swiglu_reference(xr)
    _close(y, yr, dtype)
    _close(y, megatron_swiglu(x.detach()), dtype)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    _close(x.grad, xr.grad, dtype)


def _freqs(s, rot, per_batch=0):
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    f = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    f = torch.cat((f, f), dim=-1)[:, None, None, :]
    return f + torch.randn(s, per_batch, 1, rot) if per_batch else f  # angles varying along b too


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_on_q_and_k_in_one_launch_matches_reference(dtype, interleaved, monkeypatch):
    monkeypatch.setattr(trope, "TILE", 32)  # one head per program: several head blocks
    s, b, hq, hk, d, rot = 5, 2, 3, 2, 24, 16  # GQA, 8 channels pass through
    freqs = _freqs(s, rot, per_batch=b if interleaved else 0)
    q = torch.randn(s, b, hq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(s, b, hk, d, dtype=dtype, requires_grad=True)
    qr, kr = _leaf(q), _leaf(k)
    launches = []
    real = trope._launch
    monkeypatch.setattr(trope, "_launch", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    qo, ko = trope.rotary_pos_emb_qk(q, k, freqs, interleaved, 1.25)
    qor, kor = (rotary_pos_emb_reference(t, freqs, interleaved, 1.25) for t in (qr, kr))
    _close(qo, qor, dtype)
    _close(ko, kor, dtype)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    ((qo * gq).sum() + (ko * gk).sum()).backward()
    ((qor * gq).sum() + (kor * gk).sum()).backward()
    assert len(launches) == 2  # one forward, one backward for q and k together
    _close(q.grad, qr.grad, dtype)
    _close(k.grad, kr.grad, dtype)


def test_rope_single_tensor_on_a_strided_view_and_the_reference_fallbacks():
    qkv = torch.randn(6, 1, 4, 3 * 16, requires_grad=True)
    q = qkv[..., :16]  # Megatron's q is a view of the fused projection
    freqs = _freqs(6, 16)
    y = trope.rotary_pos_emb(q, freqs)
    yr = rotary_pos_emb_reference(q.detach(), freqs)
    _close(y, yr, torch.float32)
    y.sum().backward()
    assert qkv.grad is not None and torch.count_nonzero(qkv.grad[..., 16:]) == 0
    x64 = torch.randn(3, 1, 2, 8, dtype=torch.float64)  # fp64: the reference runs
    assert torch.equal(trope.rotary_pos_emb(x64, _freqs(3, 8)), rotary_pos_emb_reference(x64, _freqs(3, 8)))


def _routing(tokens, experts, topk):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 1] = -1e9  # an expert with no tokens
    top = logits.topk(topk, dim=1).indices
    rmap = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, top, True)
    probs = torch.zeros(tokens, experts).scatter(1, top, torch.softmax(logits.gather(1, top), -1))
    rmap[2] = False  # a dropped token
    rmap[5, 0] = rmap[5, 0] ^ True  # a token with one more (or one fewer) row than top-k
    return rmap, probs


def _megatron_row_probs(probs, rmap):
    return probs.T.contiguous().masked_select(rmap.T.contiguous())


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_permute_unpermute_match_reference(dtype, monkeypatch):
    monkeypatch.setattr(tmoe, "BLOCK_CAP", 16)  # three column blocks of hidden 37
    tokens, experts, hidden, topk = 13, 5, 37, 3
    rmap, probs = _routing(tokens, experts, topk)
    x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    p = probs.clone().requires_grad_()
    xr, pr = _leaf(x), _leaf(p)
    permuted, permuted_probs, idx, per_expert = tmoe.moe_permute(x, rmap, p)
    ref, ref_idx, ref_counts = permute_reference(xr, rmap)
    assert torch.equal(permuted, ref) and torch.equal(idx, ref_idx) and torch.equal(per_expert, ref_counts)
    assert torch.equal(permuted_probs, _megatron_row_probs(pr, rmap))
    out = tmoe.moe_unpermute(permuted * 3 - 1, idx, tokens, p, rmap)
    ref_out = unpermute_reference(ref * 3 - 1, ref_idx, _megatron_row_probs(pr, rmap), tokens)
    if dtype == torch.float32:  # fp32 sum in Megatron's (expert) order: the same bits
        assert torch.equal(out, ref_out)
    _close(out, ref_out, dtype)
    grad = torch.randn_like(out)
    ((out * grad).sum() + permuted_probs.sum()).backward()
    ((ref_out * grad).sum() + _megatron_row_probs(pr, rmap).sum()).backward()
    _close(x.grad, xr.grad, dtype)
    torch.testing.assert_close(p.grad, pr.grad, rtol=1e-4, atol=1e-5 if dtype == torch.float32 else 5e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_unpermute_without_probs_and_permute_backward(dtype):
    rmap, _ = _routing(11, 4, 2)
    x = torch.randn(11, 20, dtype=dtype, requires_grad=True)
    xr = _leaf(x)
    permuted, idx, _ = tmoe.permute(x, rmap)
    ref, ref_idx, _ = permute_reference(xr, rmap)
    out = tmoe.unpermute(permuted, idx, None, 11)
    ref_out = unpermute_reference(ref, ref_idx, None, 11)
    _close(out, ref_out, dtype)
    assert torch.count_nonzero(out[2]) == 0  # the dropped token gets nothing back
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (ref_out * g).sum().backward()
    _close(x.grad, xr.grad, dtype)
