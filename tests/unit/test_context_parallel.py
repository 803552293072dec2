"""Context parallelism without a process group: start-up errors, layout, documents, block kernels.

Every bad input of issue 15 is refused by `validate` at start-up with the flag and the fix in
the message. The layout math is checked against Megatron's split; the document helpers and
the tile path of kernels without key ranges against dense attention.
"""
from __future__ import annotations

import pytest
import torch

from feature_ctx import ctx_for
from npuspeed.features.base import FeatureError
from npuspeed.features.attention import documents
from npuspeed.features.attention.blocks import Block, CallSpec, tiled_backward, tiled_forward
from npuspeed.features.attention.kernels_cpu import AtenCPU, NpuspeedCPU
from npuspeed.features.attention.layout import CPLayout, inverse, ring_segments, ulysses_order
from npuspeed.features.context_parallel import ContextParallelFeature
from npuspeed.ops import flash_attention as cpu_flash

OK = ["--use-flash-attn", "--context-parallel-size", "2", "--seq-length", "64", "--num-attention-heads", "4"]


def _validate(argv):
    ContextParallelFeature().validate(ctx_for(argv))


@pytest.mark.parametrize("argv,needle", [
    (["--context-parallel-size", "2"], "needs --use-flash-attn"),  # Megatron's own CP would need TE
    (OK + ["--cp-comm-type", "all_gather"], "--cp-comm-type all_gather selects Transformer Engine"),
    (OK + ["--cp-comm-type", "a2a"], "use --context-parallel-algo ulysses_cp_algo"),
    (OK + ["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine"),
    (OK + ["--hierarchical-context-parallel-sizes", "2", "1"], "use --context-parallel-algo hybrid_cp_algo"),
    (["--use-flash-attn", "--context-parallel-size", "4", "--seq-length", "60"],
     "--seq-length 60 does not divide by 2 x --context-parallel-size = 8"),
    (["--use-flash-attn", "--context-parallel-size", "4", "--context-parallel-algo", "ulysses_cp_algo",
      "--num-attention-heads", "6"], "--num-attention-heads 6"),
    (["--use-flash-attn", "--context-parallel-size", "4", "--context-parallel-algo", "ulysses_cp_algo",
      "--num-attention-heads", "8", "--num-query-groups", "2"], "--num-query-groups 2"),
    (["--use-flash-attn", "--context-parallel-size", "4", "--context-parallel-algo", "hybrid_cp_algo",
      "--ulysses-degree-in-cp", "3"], "--ulysses-degree-in-cp 3 does not divide --context-parallel-size 4"),
    (["--use-flash-attn", "--context-parallel-size", "4", "--context-parallel-algo", "hybrid_cp_algo"],
     "needs --ulysses-degree-in-cp"),
    (OK + ["--ulysses-degree-in-cp", "2"], "only applies to --context-parallel-algo hybrid_cp_algo"),
    (["--use-flash-attn", "--context-parallel-size", "1", "--context-parallel-algo", "ulysses_cp_algo"],
     "do nothing with --context-parallel-size 1"),
    (OK + ["--pre-tockens", "8"], "--pre-tockens/--next-tockens"),
], ids=["no-flash-attn", "te-all-gather", "te-a2a", "te-impl", "te-hierarchical", "seq-not-2N",
        "heads-ulysses", "groups-ulysses", "hybrid-degree", "hybrid-no-degree", "degree-not-hybrid",
        "cp1-idle-algo", "band"])
def test_bad_input_refused_at_start(argv, needle):
    with pytest.raises(FeatureError) as err:
        _validate(argv)
    assert needle in str(err.value)


def test_good_input_passes_and_reports_algo():
    _validate(OK)
    _validate(["--use-flash-attn", "--context-parallel-size", "4", "--context-parallel-algo", "hybrid_cp_algo",
               "--ulysses-degree-in-cp", "2", "--seq-length", "64", "--num-attention-heads", "4",
               "--num-query-groups", "2"])
    path = ContextParallelFeature().path(ctx_for(OK + ["--context-parallel-algo", "ulysses_cp_algo"]))
    assert path.startswith("ulysses_cp_algo") and "CP 2" in path


def test_ring_segments_are_megatrons_chunks():
    # ring of 4, chunk 3: position 1 holds chunks 1 and 6
    assert [(s.start, s.length, s.local) for s in ring_segments(1, 4, 3)] == [(3, 3, 0), (18, 3, 3)]
    assert [(s.start, s.length) for s in ring_segments(0, 1, 8)] == [(0, 16)]  # Ulysses alone: one segment


def test_ulysses_order_gives_the_coarse_chunks():
    """CP 4 = Ulysses 2 x ring 2, f = 2 tokens: group 0 holds CP ranks 0, 1 = fine chunks
    (0, 7) and (1, 6); after the all-to-all and reorder: chunks 0, 1 | 6, 7 = coarse 0 | 3."""
    f, members = 2, 2
    fine = torch.arange(16).view(8, f)
    arrived = torch.cat([fine[[0, 7]].flatten(), fine[[1, 6]].flatten()])  # member-major
    order = ulysses_order(members, 2 * f)
    assert arrived[order].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert torch.equal(order[inverse(order)], torch.arange(order.numel()))


def test_hybrid_layout():
    assert CPLayout.make("hybrid_cp_algo", 8, 2) == CPLayout("hybrid_cp_algo", 8, 2, 4)
    assert CPLayout.make("ulysses_cp_algo", 4).ring == 1 and CPLayout.make("megatron_cp_algo", 4).ulysses == 1


def test_documents_from_cu_seqlens():
    docs = documents.from_cu_seqlens(torch.tensor([0, 3, 8, 10, 16], dtype=torch.int32), b=2, s=8)
    assert docs.bounds == [[0, 3, 8], [0, 2, 8]] and docs.count == 4
    assert docs.starts[0].tolist() == [0, 0, 0, 3, 3, 3, 3, 3] and docs.ends[1, :2].tolist() == [2, 2]
    assert documents.tiles(docs, 4, 4, 0, 4) == [[(0, 4, 3, 4)], [(0, 4, 2, 4)]]
    assert not documents.visible(documents.from_cu_seqlens(torch.tensor([0, 4, 8]), 1, 8), 4, 4, 0, 4)
    with pytest.raises(FeatureError, match="must rise strictly from 0 to b"):
        documents.from_cu_seqlens(torch.tensor([0, 5, 12]), b=2, s=8)


def _dense(q, k, v, scale, allowed):
    s = torch.einsum("sbhd,tbhd->bhst", q.double(), k.double().repeat_interleave(q.shape[2] // k.shape[2], 2))
    s = (s * scale).masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhst,tbhd->sbhd", s.softmax(-1), v.double().repeat_interleave(q.shape[2] // k.shape[2], 2))


@pytest.mark.parametrize("kernel", ["aten", "npuspeed"])
def test_block_with_documents_matches_dense(kernel):
    """One diagonal causal block over three documents: key ranges (npuspeed) or tiles (aten)."""
    if kernel == "npuspeed" and cpu_flash.fp32_reason():
        pytest.skip(cpu_flash.fp32_reason())
    gen = torch.Generator().manual_seed(3)
    s, b, hq, hk, d = 12, 2, 4, 2, 8
    q = torch.randn(s, b, hq, d, generator=gen, requires_grad=True)
    k, v = (torch.randn(s, b, hk, d, generator=gen, requires_grad=True) for _ in range(2))
    docs = documents.from_cu_seqlens(torch.tensor([0, 4, 9, 12, 17, 24], dtype=torch.int32), b, s)
    block = Block(0, 0, True)
    impl = AtenCPU() if kernel == "aten" else NpuspeedCPU(torch.float32)
    if impl.key_ranges:
        block.key_lo, block.key_hi = documents.ranges(docs, 0, s, causal=True)
    else:
        block.tiles = documents.tiles(docs, 0, s, 0, s)
    spec = CallSpec(scale=d ** -0.5)
    out, lse = tiled_forward(impl, q, k, v, block, spec)
    doc_of = torch.searchsorted(torch.tensor([[0, 4, 9, 12], [0, 5, 12, 12]]), torch.arange(s).expand(b, s).contiguous(),
                                right=True)
    allowed = (doc_of[:, :, None] == doc_of[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    ref = _dense(q, k, v, d ** -0.5, allowed[:, None])
    assert (out.double() - ref).abs().max() < 1e-5
    dout = torch.randn_like(out)
    grads = tiled_backward(impl, dout, q, k, v, out, lse, block, spec)
    ref.backward(dout.double())
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert (got.double() - want).abs().max() < 1e-5
