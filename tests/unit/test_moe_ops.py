"""The MoE ops against Megatron's unfused algorithm: permute / unpermute and the weighted
SwiGLU, forward and backward, fp32 and bf16, an expert with no tokens, capacity-style maps,
and the proof that permute allocates no [tokens x experts] tensor."""
from __future__ import annotations

import pytest
import torch

from npuspeed.ops import _dispatch
from npuspeed.ops.moe_permute import moe_permute, moe_unpermute, permute_reference, unpermute_reference
from npuspeed.ops.moe_swiglu import weighted_swiglu, weighted_swiglu_reference

pytestmark = pytest.mark.skipif(not _dispatch.has_op("moe_permute"), reason="C++ op library not built")


def _routing(tokens: int, experts: int, topk: int, empty: int | None = None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    if empty is not None:
        logits[:, empty] = -1e9  # no token picks this expert
    top = logits.topk(topk, dim=1).indices
    rmap = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, top, True)
    probs = torch.zeros(tokens, experts).scatter(1, top, torch.softmax(logits.gather(1, top), -1))
    return rmap, probs


def _megatron_row_probs(probs, rmap):
    return probs.T.contiguous().masked_select(rmap.T.contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 6, 40, 2), (64, 8, 33, 1), (5, 4, 7, 3)])
def test_permute_unpermute_match_megatron(dtype, shape):
    tokens, experts, hidden, topk = shape
    rmap, probs = _routing(tokens, experts, topk, empty=1)
    x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    p = probs.clone().requires_grad_()
    x_ref, p_ref = x.detach().clone().requires_grad_(), probs.clone().requires_grad_()
    before = _dispatch.calls()
    permuted, permuted_probs, idx, per_expert = moe_permute(x, rmap, p)
    ref, ref_idx, ref_counts = permute_reference(x_ref, rmap)
    assert torch.equal(permuted, ref) and torch.equal(idx, ref_idx) and torch.equal(per_expert, ref_counts)
    assert per_expert[1] == 0
    assert torch.equal(permuted_probs, _megatron_row_probs(p_ref, rmap))
    y = permuted * 3 - 1  # stands in for the experts
    out = moe_unpermute(y, idx, tokens, p, rmap)
    ref_out = unpermute_reference(ref * 3 - 1, ref_idx, _megatron_row_probs(p_ref, rmap), tokens)
    tol = 0 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), ref_out.float(), atol=tol, rtol=tol)
    grad = torch.randn_like(out)
    ((out * grad).sum() + permuted_probs.sum()).backward()
    ((ref_out * grad).sum() + _megatron_row_probs(p_ref, rmap).sum()).backward()
    assert torch.allclose(x.grad.float(), x_ref.grad.float(), atol=tol, rtol=tol)
    assert torch.allclose(p.grad, p_ref.grad, atol=1e-5 if dtype == torch.float32 else 5e-2, rtol=1e-4)
    after = _dispatch.calls()
    assert after.get(("moe_permute", "cpp"), 0) > before.get(("moe_permute", "cpp"), 0)
    assert after.get(("moe_unpermute", "cpp"), 0) > before.get(("moe_unpermute", "cpp"), 0)


def test_unpermute_without_probs_sums_each_tokens_rows_in_expert_order():
    rmap, _ = _routing(50, 5, 2)
    x = torch.randn(50, 16, dtype=torch.float64)
    permuted, _, idx, _ = moe_permute(x, rmap)
    assert torch.equal(moe_unpermute(permuted, idx, 50), x * 2)
    assert torch.equal(moe_unpermute(permuted, idx, 50), unpermute_reference(permuted, idx, None, 50))


def test_capacity_maps_and_rows_without_experts():
    """Dropped tokens (rows with fewer experts, or none) and a padded-capacity map."""
    rmap, _ = _routing(40, 4, 2)
    rmap[::3, :] = False  # every third token dropped everywhere
    rmap[1::5, 0] = False
    x = torch.randn(40, 12)
    permuted, _, idx, counts = moe_permute(x, rmap)
    ref, ref_idx, ref_counts = permute_reference(x, rmap)
    assert torch.equal(permuted, ref) and torch.equal(idx, ref_idx) and torch.equal(counts, ref_counts)
    out = moe_unpermute(permuted, idx, 40)
    assert torch.equal(out[::3], torch.zeros_like(out[::3]))
    cap = torch.zeros(40, 4, dtype=torch.bool)
    cap[:10, 0] = cap[5:15, 1] = cap[30:40, 2] = cap[::4, 3] = True  # 10 tokens per expert
    permuted, _, idx, counts = moe_permute(x, cap)
    assert counts.tolist() == [10, 10, 10, 10] and torch.equal(idx, permute_reference(x, cap)[1])


def test_no_tokens_at_all():
    x = torch.randn(0, 8, requires_grad=True)
    rmap = torch.zeros(0, 4, dtype=torch.bool)
    permuted, _, idx, counts = moe_permute(x, rmap, torch.zeros(0, 4))
    assert permuted.shape == (0, 8) and counts.tolist() == [0, 0, 0, 0]
    out = moe_unpermute(permuted, idx, 0)
    out.sum().backward()
    assert x.grad.shape == (0, 8)


def test_permute_allocates_no_tokens_by_experts_tensor(npuspeed_runtime):
    """Megatron's permute makes [E, T] copies of the map and probabilities; ours only [T]-sized
    index tensors and the [T*k, H] output (the CPU tracking allocator measures it)."""
    acc = npuspeed_runtime.accelerator
    if not acc.enable_memory_tracking():
        pytest.skip("CPU memory tracking unavailable")
    tokens, experts, hidden, topk = 8192, 64, 8, 2
    rmap, probs = _routing(tokens, experts, topk)
    x = torch.randn(tokens, hidden)

    def peak(fn):
        base = acc.memory_allocated()
        acc.reset_peak_memory_stats()
        result = fn()
        return acc.max_memory_allocated() - base, result

    ours, _ = peak(lambda: moe_permute(x, rmap, probs))
    megatron, _ = peak(lambda: (permute_reference(x, rmap), _megatron_row_probs(probs, rmap)))
    rows = tokens * topk
    outputs = rows * hidden * 4 + rows * 8 + rows * 4 + experts * 8  # tokens, indices, probs, counts
    dense_probs = tokens * experts * 4  # one fp32 [T, E] temporary
    assert ours < outputs + 2 * rows * 8 + 64 * 1024  # the rows' expert ids and gather indices, slack
    assert ours < dense_probs  # no [T x E] temporary could fit
    assert megatron > ours + dense_probs  # the unfused path does make them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_swiglu_matches_megatron(dtype):
    x = torch.randn(29, 2 * 35, dtype=dtype, requires_grad=True)
    probs = torch.rand(29, requires_grad=True)
    x_ref, p_ref = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    before = _dispatch.calls().get(("moe_weighted_swiglu", "cpp"), 0)
    y, y_ref = weighted_swiglu(x, probs), weighted_swiglu_reference(x_ref, p_ref)
    assert _dispatch.calls().get(("moe_weighted_swiglu", "cpp"), 0) == before + 1
    grad = torch.randn_like(y)
    (y * grad).sum().backward()
    (y_ref * grad).sum().backward()
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    assert torch.allclose(y.float(), y_ref.float(), **tol)
    assert torch.allclose(x.grad.float(), x_ref.grad.float(), **tol)
    assert torch.allclose(probs.grad, p_ref.grad, atol=1e-5 if dtype == torch.float32 else 0.1, rtol=1e-3)
