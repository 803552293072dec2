"""EMULATOR (not the real op) of torch_npu's npu_moe_token_permute_with_routing_map_grad and
npu_moe_token_unpermute_with_routing_map_grad: the backward ops of emulate_permute.py's forward
emulators (see there for the documentation followed and sorted_indices' meaning). The unpermute
grad takes (out_index, permuted_token_id), the private _npu_moe_token_unpermute_with_routing_map's
outputs: permuted_tokens_grad[out_index[i]] = unpermuted_tokens_grad[permuted_token_id[i]]
(-1: an unused slot), then weighted by each row's probability; the probability gradient is
sum(row grad * permuted row), scattered back to [tokens, experts] (the CANN operator's formula).
"""
from __future__ import annotations

import torch

from .emulate_limits import limit
from .emulate_permute import _check_map, _rows

def npu_moe_token_permute_with_routing_map_grad(permuted_token_out_grad, probs_grad, sorted_indices, routing_map,
                                                experts_num, tokens_num, drop_and_pad):
    op = "npu_moe_token_permute_with_routing_map_grad"
    g = permuted_token_out_grad
    _check_map(op, routing_map, tokens_num)
    limit(op, sorted_indices.dtype == torch.int32 and sorted_indices.dim() == 1, "sorted_indices must be 1-D int32")
    tokens_grad = torch.zeros(tokens_num, g.shape[1], dtype=torch.float32, device=g.device)
    p_grad = None if probs_grad is None else torch.zeros(tokens_num, experts_num, dtype=probs_grad.dtype, device=g.device)
    if drop_and_pad:
        src = sorted_indices.long()
        tokens_grad.index_add_(0, src, g.float())
        if p_grad is not None:
            experts = torch.arange(experts_num, device=g.device).repeat_interleave(src.numel() // max(experts_num, 1))
            p_grad.index_put_((src, experts), probs_grad, accumulate=True)
        return tokens_grad.to(g.dtype), p_grad
    topk = sorted_indices.numel() // tokens_num if tokens_num else 0
    rows = sorted_indices.long().view(tokens_num, topk)
    tokens_grad = g.float()[rows].sum(1)
    if p_grad is not None:
        expert, token = _rows(routing_map)
        p_grad[token, expert] = probs_grad
    return tokens_grad.to(g.dtype), p_grad


def npu_moe_token_unpermute_with_routing_map_grad(unpermuted_tokens_grad, out_index, permuted_token_id, routing_map,
                                                  permuted_tokens, probs, drop_and_pad, restore_shape):
    op = "npu_moe_token_unpermute_with_routing_map_grad"
    g, dev = unpermuted_tokens_grad, unpermuted_tokens_grad.device
    limit(op, probs is None or (routing_map is not None and permuted_tokens is not None),
          "probs needs routing_map and permuted_tokens")
    valid = out_index >= 0
    rows, toks = out_index[valid].long(), permuted_token_id[valid].long()
    grad_rows = torch.zeros(out_index.numel(), g.shape[1], dtype=torch.float32, device=dev)
    grad_rows[rows] = g.float()[toks]
    if probs is None:
        return grad_rows.to(g.dtype), None
    if drop_and_pad:  # row r serves expert r // capacity
        tokens, experts = toks, rows // (out_index.numel() // routing_map.shape[1])
    else:  # rows in expert order: routing_map's selections, expert-major
        experts, tokens = _rows(routing_map)
        rows = torch.arange(tokens.numel(), device=dev)
    row_probs = torch.zeros(out_index.numel(), dtype=torch.float32, device=dev)
    row_probs[rows] = probs.float()[tokens, experts]
    row_grad = (grad_rows * permuted_tokens.float()).sum(1)
    p_grad = torch.zeros(probs.shape, dtype=torch.float32, device=dev)
    p_grad.index_put_((tokens, experts), row_grad[rows], accumulate=True)
    return (grad_rows * row_probs.unsqueeze(1)).to(g.dtype), p_grad.to(g.dtype)


EMULATORS = {f.__name__: f for f in (npu_moe_token_permute_with_routing_map_grad,
                                     npu_moe_token_unpermute_with_routing_map_grad)}
