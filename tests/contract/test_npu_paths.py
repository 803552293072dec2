"""npuspeed's NPU code paths, run on CPU through each release's stand-in torch_npu: every call
binds to the wheel's schema, every output matches the wheel's meta function, the numbers (from
the emulators) match npuspeed's reference math, forward and backward. A contract check, not a
run on NPU hardware."""
from __future__ import annotations

import pytest
import torch

from npu_contract import on_host, standin, wheel


@pytest.fixture(params=wheel.RELEASES)
def npu(request):
    release = request.param
    module = standin.module(release)
    with on_host.npu_tensors(module):
        yield standin.release(release), module


def _ran(rel, op, before):
    return rel.calls.get(op, 0) - before.get(op, 0)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _check_grads(npu_out, ref_out, npu_in, ref_in, **tol):
    gen = torch.Generator().manual_seed(7)
    grad = torch.randn(ref_out.shape, generator=gen)
    npu_out.backward(grad)
    ref_out.backward(grad)
    for a, b in zip(npu_in, ref_in):
        torch.testing.assert_close(a.grad, b.grad, **tol)


def test_rms_norm(npu):
    from npuspeed.ops.rms_norm import rms_norm, rms_norm_reference

    rel, _ = npu
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 3, 32, generator=gen), torch.rand(32, generator=gen) + 0.5
    (xa, wa), (xb, wb) = _leaves(x, w), _leaves(x, w)
    before = dict(rel.calls)
    out = rms_norm(xa, wa, 1e-5)
    ref = rms_norm_reference(xb, wb, 1e-5)
    assert _ran(rel, "npu_rms_norm", before) == 1
    torch.testing.assert_close(out, ref)
    _check_grads(out, ref, (xa, wa), (xb, wb))


def test_swiglu_and_its_moe_weighted_form(npu):
    from npuspeed.ops.moe_swiglu import weighted_swiglu, weighted_swiglu_reference
    from npuspeed.ops.swiglu import swiglu, swiglu_reference

    rel, _ = npu
    gen = torch.Generator().manual_seed(1)
    x, probs = torch.randn(6, 2, 16, generator=gen), torch.rand(12, generator=gen)
    (xa,), (xb,) = _leaves(x), _leaves(x)
    before = dict(rel.calls)
    out, ref = swiglu(xa), swiglu_reference(xb)
    torch.testing.assert_close(out, ref)
    _check_grads(out, ref, (xa,), (xb,))
    (xa, pa), (xb, pb) = _leaves(x.view(12, 16), probs), _leaves(x.view(12, 16), probs)
    out, ref = weighted_swiglu(xa, pa), weighted_swiglu_reference(xb, pb)
    torch.testing.assert_close(out, ref)
    _check_grads(out, ref, (xa, pa), (xb, pb))
    assert _ran(rel, "npu_swiglu", before) == 2


@pytest.mark.parametrize("mscale", [1.0, 1.3])
def test_rotary_pos_emb(npu, mscale):
    from npuspeed.ops.rope import rotary_pos_emb, rotary_pos_emb_reference

    rel, _ = npu
    gen = torch.Generator().manual_seed(2)
    s, b, h, d = 8, 2, 4, 16
    t = torch.randn(s, b, h, d, generator=gen)
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    freqs = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    (ta,), (tb,) = _leaves(t), _leaves(t)
    before = dict(rel.calls)
    out = rotary_pos_emb(ta, freqs, False, mscale)
    ref = rotary_pos_emb_reference(tb, freqs, False, mscale)
    assert _ran(rel, "npu_rotary_mul", before) == 1
    torch.testing.assert_close(out, ref)
    _check_grads(out, ref, (ta,), (tb,))


def _top_k_routing(tokens, experts, k, gen):
    scores = torch.rand(tokens, experts, generator=gen)
    top = scores.topk(k, dim=-1).indices
    routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    return routing, torch.where(routing, scores, torch.zeros(()))


def test_moe_token_permute_and_unpermute(npu):
    from npuspeed.ops import moe_permute as mp

    rel, module = npu
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randn(10, 8, generator=gen)
    routing, probs = _top_k_routing(10, 4, 2, gen)
    if not hasattr(module, mp.NPU_PERMUTE):  # torch_npu 2.6.0: npuspeed's own kernels run
        assert mp.implementation(tokens) == "reference"
        return
    (ta, pa), (tb, pb) = _leaves(tokens, probs), _leaves(tokens, probs)
    before = dict(rel.calls)
    permuted, _, sorted_indices, per_expert = mp.moe_permute(ta, routing, pa)
    out = mp.moe_unpermute(permuted, sorted_indices, 10, probs=pa, routing_map=routing)
    assert _ran(rel, mp.NPU_PERMUTE, before) == 1 and _ran(rel, mp.NPU_UNPERMUTE, before) == 1
    assert per_expert.tolist() == routing.sum(0).tolist()
    ref = (tb * pb.sum(dim=1, keepdim=True))  # each token's rows, weighted and summed back
    torch.testing.assert_close(out, ref)
    _check_grads(out, ref, (ta,), (tb,))


def test_grouped_matmul(npu):
    from npuspeed.features.moe_grouped_gemm import grouped_gemm

    rel, _ = npu
    gen = torch.Generator().manual_seed(4)
    counts = [3, 0, 5]
    x, w = torch.randn(8, 16, generator=gen), torch.randn(3, 16, 8, generator=gen)
    (xa, wa), (xb, wb) = _leaves(x, w), _leaves(x, w)
    before = dict(rel.calls)
    out = grouped_gemm.grouped_mm(xa, wa, counts, backend="npu")
    ref = grouped_gemm.grouped_mm(xb, wb, counts, backend="loop")
    assert _ran(rel, "npu_grouped_matmul", before) >= 1
    torch.testing.assert_close(out, ref)
    _check_grads(out, ref, (xa, wa), (xb, wb))


def _naive_attention(q, k, v, scale, causal):
    """[s, b, h, d] -> [s, b, h * d]; GQA by repeating k/v heads."""
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v)
    return out.reshape(q.shape[0], q.shape[1], -1)


def test_fused_attention_sbh_causal(npu):
    from npuspeed.features.fused_attention.npu import npu_attention
    from npuspeed.features.fused_attention.masks import MaskPlan

    rel, module = npu
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(6, 2, h, 8, generator=gen) for h in (4, 2, 2))
    (qa, ka, va), (qb, kb, vb) = _leaves(q, k, v), _leaves(q, k, v)
    before = dict(rel.calls)
    out = npu_attention(module, qa, ka, va, MaskPlan(causal=True), scale=8 ** -0.5, dropout_p=0.0, sparse_mode=None)
    ref = _naive_attention(qb, kb, vb, 8 ** -0.5, causal=True)
    torch.testing.assert_close(out, ref)
    _check_grads(out, ref, (qa, ka, va), (qb, kb, vb))
    assert _ran(rel, "npu_fusion_attention", before) == 1 and _ran(rel, "npu_fusion_attention_grad", before) == 1


@pytest.mark.parametrize("documents", [False, True], ids=["dense", "documents-varlen"])
def test_context_parallel_blocks(npu, documents):
    from npuspeed.features.attention.blocks import Block, CallSpec, tiled_backward, tiled_forward
    from npuspeed.features.attention.kernels_device import NpuFusion

    rel, module = npu
    gen = torch.Generator().manual_seed(6)
    s, b, d = 8, 2, 8
    q, k, v = (torch.randn(s, b, h, d, generator=gen) for h in (4, 2, 2))
    tiles = [[(0, 3, 0, 3), (3, 8, 3, 8)], [(0, 5, 0, 5), (5, 8, 5, 8)]] if documents else None
    block, spec = Block(0, 0, True, tiles=tiles), CallSpec(scale=d ** -0.5)
    kernel = NpuFusion(module)
    before = dict(rel.calls)
    out, lse = tiled_forward(kernel, q, k, v, block, spec)
    dout = torch.randn(out.shape, generator=gen)
    dq, dk, dv = tiled_backward(kernel, dout, q, k, v, out, lse, block, spec)
    assert _ran(rel, "npu_fusion_attention", before) >= 1 and _ran(rel, "npu_fusion_attention_grad", before) >= 1
    qa, ka, va = _leaves(q, k, v)
    ref = torch.zeros(s, b, 4 * d)
    for row in range(b):
        r = slice(row, row + 1)
        for q0, q1, k0, k1 in (tiles[row] if documents else [(0, s, 0, s)]):
            ref[q0:q1, r] = _naive_attention(qa[q0:q1, r], ka[k0:k1, r], va[k0:k1, r], spec.scale, True)
    torch.testing.assert_close(out.reshape(s, b, -1), ref, atol=1e-5, rtol=1e-5)
    ref.backward(dout.reshape(s, b, -1))
    for got, leaf in zip((dq, dk, dv), (qa, ka, va)):
        torch.testing.assert_close(got, leaf.grad, atol=1e-5, rtol=1e-5)


def test_gradient_accumulation_matmul_add(npu, monkeypatch):
    rel, _ = npu
    acc = on_host.npu_accelerator(rel.release, monkeypatch)
    gen = torch.Generator().manual_seed(8)
    grad_out, total_in = torch.randn(6, 4, generator=gen), torch.randn(6, 5, generator=gen)
    main_grad = torch.randn(4, 5, generator=gen)
    expected = main_grad + grad_out.t() @ total_in
    assert acc.has_matmul_add_fp32()  # the probe's tiny call bound and ran
    before = dict(rel.calls)
    acc.matmul_add_fp32(grad_out.bfloat16(), total_in.bfloat16(), main_grad)
    assert _ran(rel, "_npu_matmul_add_fp32", before) == 1
    torch.testing.assert_close(main_grad, expected, atol=0.05, rtol=0.02)
    # without the NNAL package torch_npu's lazy ATB wrapper raises OSError: the op is absent
    missing = on_host.npu_accelerator(rel.release, monkeypatch, nnal=False)
    assert not missing.has_matmul_add_fp32() and "nnal" in missing.matmul_add_fp32_missing().lower()


def test_rms_norm_with_a_weight_of_another_dtype_takes_the_reference(npu):
    """npu_rms_norm's gamma must have x's dtype (its documentation): a mixed pair runs the
    reference instead of a call the kernel refuses."""
    from npuspeed.ops import _dispatch
    from npuspeed.ops.rms_norm import rms_norm, rms_norm_reference

    rel, _ = npu
    x, w = torch.randn(4, 32).bfloat16(), torch.rand(32) + 0.5
    before, calls = dict(rel.calls), _dispatch.calls().get(("rms_norm", "reference"), 0)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    assert _ran(rel, "npu_rms_norm", before) == 0
    assert _dispatch.calls().get(("rms_norm", "reference"), 0) == calls + 1


def test_moe_permute_with_fp16_tokens_and_fp32_probs_takes_the_reference(npu):
    """torch_npu's permute takes probs of the tokens' dtype, or fp32 with bf16 tokens only."""
    from npuspeed.ops import moe_permute as mp

    rel, module = npu
    if not hasattr(module, mp.NPU_PERMUTE):  # 2.6.0: npuspeed's own kernels run
        assert mp.implementation(torch.randn(6, 8).half()) == "reference"
        return
    gen = torch.Generator().manual_seed(9)
    routing, probs = _top_k_routing(6, 4, 2, gen)
    before = dict(rel.calls)
    mp.moe_permute(torch.randn(6, 8).half(), routing, probs, num_out_tokens=12)  # fp32 probs
    assert _ran(rel, mp.NPU_PERMUTE, before) == 0
    mp.moe_permute(torch.randn(6, 8).bfloat16(), routing, probs, num_out_tokens=12)
    assert _ran(rel, mp.NPU_PERMUTE, before) == 1


@pytest.mark.parametrize("pattern", ["band", "mask", "causal-dropout"])
def test_fused_attention_masks_and_dropout(npu, pattern):
    """The band (compressed mask, sparse_mode 4), an explicit mask (mode 0) and dropout through
    keep_prob: npuspeed's call through the release's schema, its gradient through
    npu_fusion_attention_grad given the forward's seed/offset, against autograd of the emulator
    drawing the same mask."""
    from npu_contract import emulate_attention
    from npuspeed.features.fused_attention.npu import npu_attention
    from npuspeed.features.fused_attention.masks import MaskPlan

    rel, module = npu
    gen = torch.Generator().manual_seed(10)
    s, b, d = 7, 2, 8
    q, k, v = (torch.randn(s, b, h, d, generator=gen) for h in (4, 2, 2))
    explicit = torch.rand(b, 1, s, s, generator=gen) > 0.7
    explicit[..., 0] = False
    plan = {"band": MaskPlan(band=(2, 0)), "mask": MaskPlan(mask=explicit),
            "causal-dropout": MaskPlan(causal=True)}[pattern]
    p = 0.25 if pattern == "causal-dropout" else 0.0
    (qa, ka, va), (qb, kb, vb) = _leaves(q, k, v), _leaves(q, k, v)
    rel.log.clear()
    out = npu_attention(module, qa, ka, va, plan, scale=d ** -0.5, dropout_p=p, sparse_mode=None)
    (name, bound), = [(n, bd) for n, bd in rel.log if n == "npu_fusion_attention"]
    assert bound["input_layout"] == "SBH" and bound["keep_prob"] == 1.0 - p
    assert bound["sparse_mode"] == {"band": 4, "mask": 0, "causal-dropout": 2}[pattern]
    kwargs = {n: bound[n] for n in ("atten_mask", "scale", "keep_prob", "pre_tockens", "next_tockens", "sparse_mode")}
    if p:  # the same keep mask: the forward's seed and offset, as the grad op gets them
        seed, offset = rel.outputs["npu_fusion_attention"][4:6]
        kwargs.update(seed=seed, offset=offset)
    ref = emulate_attention.npu_fusion_attention(*(t.reshape(s, b, -1) for t in (qb, kb, vb)), 4, "SBH", **kwargs)[0]
    torch.testing.assert_close(out, ref)
    _check_grads(out, ref, (qa, ka, va), (qb, kb, vb))

