"""--moe-grouped-gemm: the grouped matmul backends against one mm per expert, and Megatron's
GroupedMLP (patched) against SequentialMLP holding the same weights, fp32 and bf16, with an
expert that gets no tokens; the counters prove the grouped GEMM ran."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from npuspeed import telemetry
from npuspeed.features.moe_grouped_gemm.grouped_gemm import backend_for, grouped_mm
from npuspeed.features.moe_grouped_gemm.grouped_mlp import MEGATRON_RANGE
from npuspeed.patching.versions import in_range

GROUPED_MLP = in_range(MEGATRON_RANGE)  # megatron-core's GroupedMLP (0.13-0.16), else npuspeed's module


def _per_expert(x, w, counts):
    return torch.cat([a @ b for a, b in zip(x.split(counts), w)]) if x.shape[0] else x.new_zeros(0, w.shape[2])


@pytest.mark.parametrize("backend", ["torch", "loop", "loop_fp32", "linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[5, 0, 17, 10], [0, 0, 0, 0], [3, 1, 0, 0]])
def test_grouped_mm_forward_backward(backend, dtype, counts):
    if backend == "torch" and backend_for(torch.empty(0, dtype=dtype)) != "torch":
        pytest.skip("no torch grouped mm for this CPU dtype")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 24, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(4, 24, 40, generator=gen).to(dtype).requires_grad_()
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    before = telemetry.get(f"moe.grouped_gemm.{backend}")
    y = grouped_mm(x, w, counts, backend=backend)
    assert telemetry.get(f"moe.grouped_gemm.{backend}") == before + 1
    y_ref = _per_expert(x_ref, w_ref, counts)
    g = torch.randn(y.shape, generator=gen).to(dtype)
    (y * g).sum().backward()
    (y_ref * g).sum().backward() if y_ref.requires_grad else None
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(y, y_ref.detach(), **tol)
    torch.testing.assert_close(x.grad, x_ref.grad if x_ref.grad is not None else torch.zeros_like(x), **tol)
    w_ref_grad = w_ref.grad if w_ref.grad is not None else torch.zeros_like(w)
    torch.testing.assert_close(w.grad, w_ref_grad, **tol)
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.count_nonzero(w.grad[e]) == 0  # an expert without tokens: zero, defined gradient


def test_grouped_mm_rejects_bad_counts():
    with pytest.raises(ValueError, match="sum to the 4 rows"):
        grouped_mm(torch.zeros(4, 3), torch.zeros(2, 3, 5), [1, 2])


def test_cpu_backend_is_torch_grouped_mm():
    """torch 2.13's CPU build has grouped mm for fp32 and bf16: the fallback is not what runs."""
    assert hasattr(torch, "_grouped_mm")
    assert backend_for(torch.empty(0)) == "torch"
    assert backend_for(torch.empty(0, dtype=torch.bfloat16)) == "torch"


def _mlp_pair(dtype, swiglu: bool):
    """SequentialMLP and (patched) GroupedMLP of 4 experts holding the same weights."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24,
                               moe_ffn_hidden_size=24, num_moe_experts=4, add_bias_linear=False,
                               gated_linear_unit=swiglu, activation_func=F.silu if swiglu else F.gelu,
                               bias_activation_fusion=False, use_cpu_initialization=True,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16)
    pg = get_default_pg_collection()
    seq = SequentialMLP(4, config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                        pg_collection=pg)
    if not GROUPED_MLP:  # 0.17+: the local spec's experts, which --moe-grouped-gemm makes npuspeed's module
        from megatron.core.models.backends import LocalSpecProvider

        grouped = LocalSpecProvider().grouped_mlp_modules(True)(4, config, pg_collection=pg)
        assert getattr(grouped, "npuspeed_grouped", False), type(grouped)
        grouped.load_state_dict(seq.state_dict())  # SequentialMLP's layout
        return seq, grouped
    from megatron.core.transformer.moe.experts import GroupedMLP

    grouped = GroupedMLP(4, config, pg_collection=pg)
    with torch.no_grad():
        w1 = grouped.weight1.view(4, 16, -1)
        w2 = grouped.weight2.view(4, -1, 16)
        for e, expert in enumerate(seq.local_experts):
            w1[e].copy_(expert.linear_fc1.weight.t())
            w2[e].copy_(expert.linear_fc2.weight.t())
    return seq, grouped


def _weight_grads(grouped):
    """Per expert (fc1, fc2) weight gradients input-major, [4, H, F1] and [4, F, H]."""
    if GROUPED_MLP:
        return grouped.weight1.grad.view(4, 16, -1), grouped.weight2.grad.view(4, -1, 16)
    experts = grouped.local_experts
    return (torch.stack([e.linear_fc1.weight.grad.t() for e in experts]),
            torch.stack([e.linear_fc2.weight.grad.t() for e in experts]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("swiglu", [True, False])
def test_grouped_mlp_matches_sequential_mlp(megatron_mp, with_features, dtype, swiglu):
    counts = torch.tensor([6, 0, 11, 3])  # expert 1 gets no tokens
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20, 16, generator=gen).to(dtype)
    probs = torch.rand(20, generator=gen)
    with with_features(["--moe-grouped-gemm"]):
        seq, grouped = _mlp_pair(dtype, swiglu)
        before = telemetry.snapshot("moe.grouped_gemm")
        results = []
        for module in (seq, grouped):
            xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
            out, bias = module(xi, counts, pi)
            assert bias is None
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype))
            results.append((out.detach(), xi.grad, pi.grad))
        assert sum(telemetry.since(before, "moe.grouped_gemm").values()) == 2  # fc1 and fc2
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=6e-2, rtol=3e-2)
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    w1_grad, w2_grad = _weight_grads(grouped)
    for e, expert in enumerate(seq.local_experts):
        torch.testing.assert_close(w1_grad[e].t().float(), expert.linear_fc1.weight.grad.float(), **tol)
        torch.testing.assert_close(w2_grad[e].t().float(), expert.linear_fc2.weight.grad.float(), **tol)
    assert torch.count_nonzero(w1_grad[1]) == 0 and torch.count_nonzero(w2_grad[1]) == 0


def test_grouped_mlp_with_no_tokens_keeps_gradients(megatron_mp, with_features):
    with with_features(["--moe-grouped-gemm"]):
        _, grouped = _mlp_pair(torch.float32, True)
        x = torch.zeros(0, 16, requires_grad=True)
        out, _ = grouped(x, torch.zeros(4, dtype=torch.long), torch.zeros(0, requires_grad=True))
        out.sum().backward()
    assert out.shape == (0, 16)
    w1_grad, _ = _weight_grads(grouped)
    assert torch.count_nonzero(w1_grad) == 0


@pytest.mark.parametrize("backend", ["torch", "loop", "loop_fp32", "linear"])
def test_calls_sharing_a_grad_sink_hand_autograd_one_summed_gradient(backend):
    """Three chunks of one weight (one with no rows): the gradient autograd gets is the sum,
    handed over once, equal to that of the unchunked call."""
    from npuspeed.features.moe_common.grad_sink import GradSink

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(3, 8, 12, generator=gen, requires_grad=True)
    chunks = [([2, 0, 3], torch.randn(5, 8, generator=gen)), ([0, 0, 0], torch.zeros(0, 8)),
              ([1, 4, 2], torch.randn(7, 8, generator=gen))]
    seen = []
    w.register_hook(lambda g: seen.append(g.clone()))
    sink = GradSink(len(chunks))
    total = sum((grouped_mm(x, w, counts, backend=backend, sink=sink) ** 2).sum() for counts, x in chunks)
    total.backward()
    assert len(seen) == 1 and sink.grad is None and sink.seen == 3
    w_ref = w.detach().clone().requires_grad_()
    sum((grouped_mm(x, w_ref, counts, backend=backend) ** 2).sum() for counts, x in chunks).backward()
    torch.testing.assert_close(w.grad, w_ref.grad, atol=1e-5, rtol=1e-5)


def test_fp32_loop_rounds_once_like_a_bf16_gemm():
    """loop_fp32 on bf16: fp32 products and sums, one rounding: equal to the fp32 result rounded."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 32, generator=gen).to(torch.bfloat16)
    w = torch.randn(2, 32, 16, generator=gen).to(torch.bfloat16)
    y = grouped_mm(x, w, [4, 5], backend="loop_fp32")
    ref = torch.cat([x[:4].float() @ w[0].float(), x[4:].float() @ w[1].float()]).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)


def test_linear_backend_runs_megatrons_gemms_bitwise():
    """`linear` (the `megatron` candidate) is SequentialMLP's arithmetic: per expert x @ W.t(),
    grad @ W and grad.t() @ x on the [N, K] weight, Megatron's linear layer's calls exactly
    (bf16: any other order or layout of the GEMMs would round differently)."""
    gen = torch.Generator().manual_seed(2)
    counts = [7, 0, 12]
    x = torch.randn(19, 32, generator=gen).to(torch.bfloat16).requires_grad_()
    w = torch.randn(3, 32, 48, generator=gen).to(torch.bfloat16).requires_grad_()
    g = torch.randn(19, 48, generator=gen).to(torch.bfloat16)
    y = grouped_mm(x, w, counts, backend="linear")
    y.backward(g)
    ys, dxs, dws = [], [], []
    for xs, gs, wg in zip(x.detach().split(counts), g.split(counts), w.detach()):
        weight = wg.t().contiguous()  # the expert's Megatron linear weight [N, K]
        ys.append(torch.matmul(xs, weight.t()))
        dxs.append(gs.matmul(weight))
        dws.append(gs.t().matmul(xs).t())
    assert torch.equal(y, torch.cat(ys)) and torch.equal(x.grad, torch.cat(dxs))
    assert torch.equal(w.grad, torch.stack(dws))
