"""The MoE patches' per-release shapes, without Megatron's runtime: 0.17+'s 5-tuple permute
(padding arguments passed through to TE's fused kernels, never dropped), and --moe-tp-extend-ep
on a TransformerConfig built before initialize_model_parallel (Megatron-LM core_v0.19)."""
from __future__ import annotations

import torch

from npuspeed.features.moe_fused_permute import permute as feature
from npuspeed.features.moe_tp_extend_ep import tp_extend_ep


def _routing():
    rmap = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    return torch.randn(4, 6), rmap, torch.rand(4, 3) * rmap


def _upstream_like(calls):
    """Megatron 0.17+'s unfused permute/unpermute contract, recording each call."""

    def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False,
                tokens_per_expert=None, align_size=0):
        calls.append(("permute", fused, align_size))
        idx = torch.arange(routing_map.shape[0]).unsqueeze(0).expand(routing_map.shape[1], -1)
        order = idx.masked_select(routing_map.T.contiguous())
        p = None if probs is None else probs.T.contiguous().masked_select(routing_map.T.contiguous())
        return tokens.index_select(0, order), p, order, ("pad" if fused else None), tokens_per_expert

    def unpermute(permuted, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
                  drop_and_pad=False, pad_offsets=None):
        calls.append(("unpermute", fused, pad_offsets))
        out = torch.zeros(restore_shape, dtype=permuted.dtype)
        return out.index_add_(0, sorted_indices, permuted)

    return permute, unpermute


def test_padded_permute_returns_five_values_and_passes_padding_to_fused_kernels(monkeypatch):
    monkeypatch.setenv("NPUSPEED_FUSED_OP_PATH", "megatron")  # the rule's choice is not what is tested here
    calls = []
    up_permute, up_unpermute = _upstream_like(calls)
    permute, unpermute = feature.permute_padded_wrapper(up_permute), feature.unpermute_padded_wrapper(up_unpermute)
    x, rmap, probs = _routing()
    tpe = rmap.sum(0)
    out = permute(x, rmap, probs, num_out_tokens=int(rmap.sum()), tokens_per_expert=tpe)
    assert len(out) == 5 and out[3] is None and out[4] is tpe  # unfused: no padding, counts as given
    back = unpermute(out[0], out[2], x.shape, routing_map=rmap)
    torch.testing.assert_close(back, x * rmap.sum(1, keepdim=True))
    # TE's kernels asked for: upstream's function with the padding arguments, untouched
    fused = permute(x, rmap, probs, num_out_tokens=int(rmap.sum()), fused=True, tokens_per_expert=tpe,
                    align_size=16)
    assert fused[3] == "pad" and ("permute", True, 16) in calls
    unpermute(fused[0], fused[2], x.shape, routing_map=rmap, fused=True, pad_offsets="pad")
    assert ("unpermute", True, "pad") in calls


class _Config:
    """The fields tp_extend_ep's config wrapper reads and writes."""

    def __init__(self, tp, ep, etp, experts=8):
        self.tensor_model_parallel_size, self.expert_model_parallel_size = tp, ep
        self.expert_tensor_parallel_size, self.num_moe_experts = etp, experts
        self.post_init_ran = 0


def _post_init(self):
    self.post_init_ran += 1


def test_config_built_before_model_parallel_init_takes_the_extended_layout_once(monkeypatch):
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)
    post_init = tp_extend_ep.early_config_wrapper(_post_init)
    config = _Config(tp=2, ep=2, etp=2)  # Megatron-LM sets expert-TP to TP by default
    post_init(config)
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (4, 1)
    post_init(config)  # e.g. dataclasses.replace runs it again: already extended, left alone
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (4, 1)
    assert config.post_init_ran == 2
    dense = _Config(tp=2, ep=1, etp=None, experts=None)
    post_init(dense)
    assert (dense.expert_model_parallel_size, dense.expert_tensor_parallel_size) == (1, None)


def test_config_built_after_init_takes_the_groups_sizes(monkeypatch):
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(parallel_state, "get_expert_model_parallel_world_size", lambda: 4)
    monkeypatch.setattr(parallel_state, "get_expert_tensor_parallel_world_size", lambda: 1)
    config = _Config(tp=2, ep=2, etp=2)
    tp_extend_ep.early_config_wrapper(_post_init)(config)
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (4, 1)
