"""Packed documents on NPU: one npu_fusion_attention call (TND, actual_seq_qlen/kvlen) per block.

No NPU exists here: the op and its gradient are the documented-contract emulator
(tests/npu_contract/emulate_attention.py, checked against a naive per-sequence reference in
test_fused_attention_npu.py). The CP 2 ring's blocks run in one process (every rank's
(query segment, key segment) blocks from RingPlan.blocks, merged by LSE as the ring merges
them, backward from the final out/LSE), with documents crossing the ring's chunk
boundaries; the TND path must equal the same kernel run tile by tile and Megatron's unfused
attention given the explicit block-diagonal mask, and make one op call per block, not one
per document piece. The non-CP packed path (fused attention -> context_parallel seam) is
checked through the patched Megatron layer.
"""
from __future__ import annotations

import pytest
import torch

from npu_contract import emulate_attention as emu
from npuspeed.features.attention import documents
from npuspeed.features.attention.blocks import CallSpec, tiled_backward, tiled_forward
from npuspeed.features.attention.kernels_device import NpuFusion
from npuspeed.features.attention.ring import RingPlan, _merge
from npuspeed.ops.npu import varlen as npu_varlen
from test_fused_attention import make_attention, make_inputs, run
from test_fused_attention_npu import npu_patched

S, B, HQ, HK, D = 24, 2, 4, 2, 16
ROWS = [[5, 9, 10], [11, 2, 11]]  # document lengths per row: both cross the CP 2 chunks (6 tokens)


class SpyNpu:
    """The emulator as torch_npu, counting calls by layout."""

    def __init__(self):
        self.calls, self.grad_calls = [], []

    def npu_fusion_attention(self, *args, **kwargs):
        self.calls.append((args[4], kwargs))
        return emu.npu_fusion_attention(*args, **kwargs)

    def npu_fusion_attention_grad(self, *args, **kwargs):
        self.grad_calls.append((args[5], kwargs))
        return emu.npu_fusion_attention_grad(*args, **kwargs)


class TileByTile(NpuFusion):
    """The same kernel without varlen: the ring runs one SBH call per document piece."""

    varlen = False


def _cu(rows):
    return torch.tensor([0] + torch.tensor([n for row in rows for n in row]).cumsum(0).tolist(), dtype=torch.int32)


def _block_diagonal(rows, causal: bool) -> torch.Tensor:
    """Megatron's explicit mask [b, 1, S, S], True = masked: other documents (and the future)."""
    doc = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])
    mask = doc[:, :, None] != doc[:, None, :]
    if causal:
        mask = mask | torch.ones(S, S, dtype=torch.bool).triu(1)
    return mask[:, None]


def _ring_blocks(kernel, q, k, v, dout, docs, causal: bool, size: int = 2):
    """Every rank's ring blocks in one process: (out, dq, dk, dv, blocks run)."""
    spec = CallSpec(scale=D ** -0.5)
    plans = [RingPlan(peers=None, size=size, position=p, chunk=S // (2 * size), causal=causal, kernel=kernel,
                      spec=spec, docs=docs) for p in range(size)]
    blocks = [(qs, ks, blk) for plan in plans for owner in range(size) for qs, ks, blk in plan.blocks(owner)]
    out = torch.zeros(q.shape)
    lse = torch.full((B, HQ, S), float("-inf"))
    for qs, ks, blk in blocks:
        ql, kl = slice(qs.start, qs.end), slice(ks.start, ks.end)
        o, l = tiled_forward(kernel, q[ql], k[kl], v[kl], blk, spec)
        _merge(out[ql], lse[..., ql], o, l)
    grads = [torch.zeros(t.shape) for t in (q, k, v)]
    for qs, ks, blk in blocks:
        ql, kl = slice(qs.start, qs.end), slice(ks.start, ks.end)
        gq, gk, gv = tiled_backward(kernel, dout[ql], q[ql], k[kl], v[kl], out[ql], lse[..., ql], blk, spec)
        grads[0][ql] += gq
        grads[1][kl] += gk
        grads[2][kl] += gv
    return (out, *grads, blocks)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
def test_cp2_ring_blocks_one_tnd_call_each(megatron_mp, causal):
    q, k, v, grad = make_inputs(S, B, HQ, HK, D, torch.float32, seed=9)
    dout = grad.view(S, B, HQ, D)
    docs = documents.from_cu_seqlens(_cu(ROWS), B, S)
    ref = run(make_attention(heads=HQ, groups=HK, d=D, mask_type="arbitrary"), q, k, v, grad,
              _block_diagonal(ROWS, causal))
    tnd, tiles = SpyNpu(), SpyNpu()
    got = _ring_blocks(NpuFusion(tnd), q, k, v, dout, docs, causal)
    by_tile = _ring_blocks(TileByTile(tiles), q, k, v, dout, docs, causal)
    blocks = got[-1]
    pieces = sum(len(row) for _, _, blk in blocks for row in blk.tiles)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), ref, got[:4], by_tile[:4]):
        a = a.reshape(b.shape)
        assert (b - a).abs().max() < 1e-5, f"TND vs Megatron {name}"
        assert (b - c).abs().max() < 1e-5, f"TND vs tile by tile {name}"
    # one op call per block (forward and backward), where tile by tile makes one per piece
    assert len(tnd.calls) == len(tnd.grad_calls) == len(blocks) < pieces
    assert len(tiles.calls) == len(tiles.grad_calls) == pieces
    assert {layout for layout, _ in tnd.calls + tnd.grad_calls} == {"TND"}
    modes = {(blk.causal, kw["sparse_mode"]) for (_, kw), (_, _, blk) in zip(tnd.calls, blocks)}
    assert modes <= {(True, 3), (False, 0)} and (causal or modes == {(False, 0)})
    for _, kw in tnd.calls:  # host lists of cumulative ends, one per piece, no leading 0
        assert isinstance(kw["actual_seq_qlen"], list) and kw["actual_seq_qlen"][0] > 0
        assert len(kw["actual_seq_qlen"]) == len(kw["actual_seq_kvlen"])


def test_a_block_with_more_pieces_than_the_op_takes_splits(monkeypatch):
    """Above the op's sequence limit (MAX_SEQUENCES, forced to 2 here) a block makes
    ceil(pieces / limit) calls and still gives the same result."""
    q, k, v, grad = make_inputs(S, B, HQ, HK, D, torch.float32, seed=3)
    dout = grad.view(S, B, HQ, D)
    docs = documents.from_cu_seqlens(_cu(ROWS), B, S)
    whole = _ring_blocks(NpuFusion(SpyNpu()), q, k, v, dout, docs, True, size=1)
    monkeypatch.setattr(npu_varlen, "MAX_SEQUENCES", 2)
    spy = SpyNpu()
    split = _ring_blocks(NpuFusion(spy), q, k, v, dout, docs, True, size=1)
    assert len(split[-1]) == 1 and len(spy.calls) == 3  # one block, 6 pieces
    assert max(len(kw["actual_seq_qlen"]) for _, kw in spy.calls) == 2
    for a, b in zip(whole[:4], split[:4]):
        assert (a - b).abs().max() < 1e-6


def test_non_cp_packed_documents_take_one_tnd_call(megatron_mp):
    """--use-flash-attn on an NPU, packed documents at CP 1 (fused attention hands the call to
    the context-parallel seam): one TND forward and one TND gradient call for the layer,
    equal to Megatron's unfused attention with the block-diagonal causal mask."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from npuspeed import telemetry

    inputs = make_inputs(S, B, HQ, HK, D, torch.float32, seed=5)
    module = make_attention(heads=HQ, groups=HK, d=D)
    ref = run(module, *inputs, _block_diagonal(ROWS, True))
    cu = _cu(ROWS)
    params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=S, max_seqlen_kv=S)
    with npu_patched(megatron_mp.accelerator) as fake:
        before = telemetry.get(npu_varlen.CALLS)
        q, k, v = (t.detach().clone().requires_grad_(True) for t in inputs[:3])
        out = module(q, k, v, None, packed_seq_params=params)
        out.backward(inputs[3])
        assert telemetry.get(npu_varlen.CALLS) == before + 1
        why = telemetry.last("attention.why.npu_fusion_attention+documents")["why"]
        assert "one varlen call per block" in why and "packed documents" in why
    got = (out.detach(), q.grad, k.grad, v.grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ref, got):
        assert (a - b).abs().max() < 1e-5, name
    assert len(fake.calls) == len(fake.grad_calls) == 1
    args, kwargs = fake.calls[0]
    assert args[4] == "TND" and args[0].shape == (B * S, HQ, D) and args[1].shape == (B * S, HK, D)
    assert kwargs["actual_seq_qlen"] == kwargs["actual_seq_kvlen"] == [5, 14, 24, 35, 37, 48]
    assert kwargs["sparse_mode"] == 3 and tuple(kwargs["atten_mask"].shape) == (2048, 2048)
    assert fake.grad_calls[0][1]["actual_seq_qlen"] == [5, 14, 24, 35, 37, 48]
