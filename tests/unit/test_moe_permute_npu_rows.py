"""torch_npu's npu_moe_token_permute_with_routing_map takes a routing map only when every row
selects the same number of experts (its documentation: "非drop_and_pad模式要求每行中为1或true的个数
固定（记为topK）", and num_out_tokens // tokens_num == topK). Megatron's all-gather dispatcher
passes the map cut to this rank's local experts, whose rows vary at EP > 1: there the portable
path runs (said once), and its sorted_indices never reach torch_npu's unpermute.

The NPU is simulated: a fake torch_npu that records every call breaking that documented rule, and the front ends'
`implementation` answering "npu" for CPU tensors."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from npuspeed.features.moe_fused_permute import permute as feature
from npuspeed.ops import _dispatch, fused_choice
from npuspeed.ops import moe_permute as ops


def _fake_torch_npu(calls):
    def permute(tokens, routing_map, *, probs=None, num_out_tokens=None, drop_and_pad=False):
        counts = routing_map.sum(dim=1)
        top_k = (num_out_tokens or tokens.shape[0]) // tokens.shape[0]
        # outside the documented contract the op's result is undefined: recorded, never hidden
        calls.append("permute" if drop_and_pad or bool((counts == top_k).all()) else "permute, rows vary")
        permuted, order, _ = ops.permute_reference(tokens, routing_map)
        return permuted, None, order.to(torch.int32)

    def unpermute(permuted, sorted_indices, restore_shape, *, probs=None, routing_map=None, drop_and_pad=False):
        calls.append("unpermute")
        return ops.unpermute_reference(permuted, sorted_indices.long(), None, restore_shape[0])

    return types.SimpleNamespace(npu_moe_token_permute_with_routing_map=permute,
                                 npu_moe_token_unpermute_with_routing_map=unpermute)


@pytest.fixture
def npu(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls))
    for module in (ops, feature):
        monkeypatch.setattr(module, "implementation", lambda tokens: "npu")
    monkeypatch.setattr(fused_choice, "CHOOSER", fused_choice.Chooser(repeats=1, budget_s=0.0))
    monkeypatch.delenv(fused_choice.FORCE_ENV, raising=False)
    monkeypatch.setattr(feature, "_SAID", set(), raising=False)
    _dispatch.reset_calls()
    return calls


def _maps(ep=2, experts=4, tokens=10, top_k=2):
    """The full top-k map and this rank's cut of it (Megatron's all-gather dispatcher at EP > 1)."""
    scores = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(0))
    full = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, scores.topk(top_k, -1).indices, True)
    local = full[:, : experts // ep]
    assert local.sum(dim=1).unique().numel() > 1  # rows select 0, 1 or 2 local experts
    return full, local


def test_front_end_uses_the_npu_op_only_for_rows_of_one_count(npu):
    full, local = _maps()
    x = torch.randn(full.shape[0], 8)
    out, _, order, _ = ops.moe_permute(x, full, num_out_tokens=int(full.sum()))
    assert npu == ["permute"] and order.dtype == torch.int32
    out, _, order, _ = ops.moe_permute(x, local, num_out_tokens=int(local.sum()))
    assert npu == ["permute"] and order.dtype == torch.int64  # the reference ran
    back = ops.moe_unpermute(out, order, x.shape[0])
    assert npu == ["permute"]  # int64 indices never reach torch_npu's unpermute
    torch.testing.assert_close(back, x * local.sum(dim=1, keepdim=True))
    assert _dispatch.calls() == {("moe_permute", "npu"): 1, ("moe_permute", "reference"): 1,
                                 ("moe_unpermute", "reference"): 1}


def test_feature_takes_megatrons_permute_for_a_local_expert_map(npu):
    """The per-shape timing sees a map whose rows agree (torch_npu's op wins it); a later map of
    the same shape whose rows differ must not reuse that choice."""
    from megatron.core.transformer.moe import moe_utils

    notes = []
    fused_choice.CHOOSER.notify = notes.append
    fused_choice.CHOOSER.trial = lambda name, run: (run(), {"megatron": 2.0, "npu": 1.0}[name])[1]
    permute = feature.wrappers()[0](moe_utils.permute)
    unpermute = feature.wrappers()[1](moe_utils.unpermute)
    _, local = _maps()
    one_each = torch.zeros_like(local).scatter_(1, torch.arange(local.shape[0]).remainder(2)[:, None], True)
    x = torch.randn(local.shape[0], 8)
    out, _, order = permute(x, one_each, num_out_tokens=int(one_each.sum()))[:3]
    unpermute(out, order, x.shape, routing_map=one_each)
    assert npu[-2:] == ["permute", "unpermute"]  # the rows agree: torch_npu's pair ran
    _dispatch.reset_calls()
    del npu[:]
    for _ in range(2):
        out, _, order = permute(x, local, num_out_tokens=int(local.sum()))[:3]
        back = unpermute(out, order, x.shape, routing_map=local)
    assert npu == []
    torch.testing.assert_close(back, x * local.sum(dim=1, keepdim=True))
    assert _dispatch.calls() == {("moe_permute", "megatron"): 2, ("moe_unpermute", "megatron"): 2}
    said = [n for n in notes if "same number of experts" in n]
    assert len(said) == 1 and "npu_moe_token_permute_with_routing_map" in said[0]
