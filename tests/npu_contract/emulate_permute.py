"""EMULATOR (not the real op) of torch_npu's MoE token permute/unpermute with a routing map
(npu_moe_token_permute_with_routing_map, _grad; npu_moe_token_unpermute_with_routing_map, its
private 4-output form and _grad), following `_op_plugin_docs.py` of torch_npu 2.9.0/2.14.0 (2.6.0
has none of them) and, for the grads' out_index/permuted_token_id, the CANN operator's README
(ops-transformer moe_token_unpermute_with_routing_map_grad).

Rows come out grouped by expert, tokens ascending within an expert (Megatron's order). Without
drop_and_pad, topK = num_out_tokens // tokens_num (num_out_tokens defaults to tokens_num, i.e.
topK 1), every routing_map row must select exactly topK experts, and sorted_indices[i] is the
permuted row of token i // topK's (i % topK)-th expert: permuted[sorted_indices[i]] ==
tokens[i // topK] (torch_npu's meaning, not Megatron's). With drop_and_pad, capacity =
num_out_tokens // experts_num rows per expert and sorted_indices[r] is row r's token (the
routed tokens first, then unrouted ones as padding, as Megatron's argsort picks them).
Documented limits: tokens 2-D fp16/bf16/fp32; routing_map 2-D [tokens, experts] int8/bool of
0/1; probs shaped as routing_map, tokens' dtype or fp32 with bf16 tokens; tokens_num and
experts_num < 16777215; num_out_tokens in [0, tokens * experts]; topK < 512 (unpermute:
<= 512); topK * tokens < 16777215; sorted_indices 1-D int32.
"""
from __future__ import annotations

import torch

from .emulate_limits import FLOATS, dtype_in, has_values, limit

BIG = 16777215


def _check_map(op, routing_map, tokens_num):
    limit(op, routing_map.dim() == 2 and routing_map.shape[0] == tokens_num,
          f"routing_map must be 2-D [tokens_num={tokens_num}, experts_num], got {tuple(routing_map.shape)}")
    limit(op, routing_map.dtype in (torch.int8, torch.bool),
          f"routing_map dtype must be int8 or bool, got {routing_map.dtype}")
    limit(op, tokens_num < BIG and routing_map.shape[1] < BIG, f"tokens_num and experts_num must be < {BIG}")
    if routing_map.dtype == torch.int8 and has_values(routing_map):
        limit(op, bool(((routing_map == 0) | (routing_map == 1)).all()), "routing_map int8 values must be 0 or 1")


def _check_probs(op, probs, routing_map, dtype):
    if probs is None:
        return
    limit(op, probs.shape == routing_map.shape,
          f"probs {tuple(probs.shape)} must be shaped as routing_map {tuple(routing_map.shape)}")
    limit(op, probs.dtype == dtype or (probs.dtype == torch.float32 and dtype == torch.bfloat16),
          f"probs dtype {probs.dtype} must be {dtype} (or fp32 with bf16 tokens)")


def _rows(routing_map):
    """(expert, token) of each permuted row in the non-padded order: expert-major, tokens ascending."""
    expert, token = routing_map.bool().T.nonzero(as_tuple=True)
    return expert, token


def _padded_tokens(routing_map, capacity):
    order = routing_map.T.int().argsort(dim=-1, descending=True, stable=True)[:, :capacity]
    return order.reshape(-1)


def npu_moe_token_permute_with_routing_map(tokens, routing_map, *, probs=None, num_out_tokens=None, drop_and_pad=False):
    op = "npu_moe_token_permute_with_routing_map"
    dtype_in(op, "tokens", tokens, FLOATS)
    limit(op, tokens.dim() == 2, f"tokens must be 2-D, got {tokens.dim()}-D")
    t, e = tokens.shape[0], routing_map.shape[-1]
    _check_map(op, routing_map, t)
    _check_probs(op, probs, routing_map, tokens.dtype)
    out = t if num_out_tokens is None else num_out_tokens
    limit(op, 0 <= out <= t * e, f"num_out_tokens {out} must lie in [0, tokens * experts = {t * e}]")
    if drop_and_pad:
        capacity = out // e if e else 0
        src = _padded_tokens(routing_map, capacity)
        experts = torch.arange(e, device=tokens.device).repeat_interleave(capacity)
        permuted_probs = None if probs is None else probs[src, experts]
        return tokens[src], permuted_probs, src.to(torch.int32)
    topk = out // t if t else 0
    limit(op, topk < 512 and topk * t < BIG,
          f"topK = num_out_tokens // tokens_num = {topk} must be < 512 (and topK * tokens < {BIG})")
    if has_values(routing_map) and t:
        per_row = routing_map.bool().sum(1)
        limit(op, bool((per_row == topk).all()),
              f"every routing_map row must select topK = num_out_tokens // tokens_num = {topk} "
              f"experts, rows select {sorted(set(per_row.tolist()))}")
    expert, token = _rows(routing_map)
    rank = (routing_map.bool().long().cumsum(1) - 1)[token, expert]  # which of its token's experts
    sorted_indices = torch.empty(t * topk, dtype=torch.int32, device=tokens.device)
    sorted_indices[token * topk + rank] = torch.arange(token.numel(), dtype=torch.int32, device=tokens.device)
    permuted_probs = None if probs is None else probs[token, expert]
    return tokens[token], permuted_probs, sorted_indices


def _unpermute_check(op, permuted_tokens, sorted_indices, restore_shape, probs, routing_map, drop_and_pad):
    dtype_in(op, "permuted_tokens", permuted_tokens, FLOATS)
    limit(op, permuted_tokens.dim() == 2, "permuted_tokens must be 2-D")
    limit(op, sorted_indices.dim() == 1 and sorted_indices.dtype == torch.int32,
          f"sorted_indices must be 1-D int32, got {sorted_indices.dtype}")
    limit(op, len(restore_shape) == 2 and restore_shape[1] == permuted_tokens.shape[1],
          f"restore_shape must be (tokens_num, hidden_size={permuted_tokens.shape[1]}), got {list(restore_shape)}")
    limit(op, sorted_indices.numel() == permuted_tokens.shape[0], "sorted_indices must have one entry per permuted row")
    t = restore_shape[0]
    if probs is not None:
        limit(op, routing_map is not None, "probs needs the routing_map")
    if routing_map is not None:
        _check_map(op, routing_map, t)
        _check_probs(op, probs, routing_map, permuted_tokens.dtype)
    if drop_and_pad:
        limit(op, routing_map is not None, "drop_and_pad needs the routing_map (its experts_num gives the capacity)")
        return None
    topk = sorted_indices.numel() // t if t else 0
    limit(op, topk * t == sorted_indices.numel(),
          f"sorted_indices' {sorted_indices.numel()} entries must be tokens_num * topK")
    limit(op, topk <= 512, f"topK {topk} must be <= 512")
    if routing_map is not None and has_values(routing_map) and t:
        limit(op, int(routing_map.bool().sum(1).max()) <= topk, f"a routing_map row selects more than topK = {topk} experts")
    return topk


def _npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, *, probs=None,
                                              routing_map=None, drop_and_pad=False):
    """(unpermuted, out_index, permuted_token_id, permuted_probs): permuted row out_index[i] adds
    to token permuted_token_id[i], weighted by permuted_probs[out_index[i]] (probs in row order)."""
    op = "npu_moe_token_unpermute_with_routing_map"
    topk = _unpermute_check(op, permuted_tokens, sorted_indices, restore_shape, probs, routing_map, drop_and_pad)
    t, dev = restore_shape[0], permuted_tokens.device
    if drop_and_pad:
        e = routing_map.shape[1]
        capacity = sorted_indices.numel() // e
        out_index = torch.arange(sorted_indices.numel(), dtype=torch.int32, device=dev)
        token_id = sorted_indices
        experts = torch.arange(e, device=dev).repeat_interleave(capacity)
        row_probs = None if probs is None else probs[sorted_indices.long(), experts]
    else:
        out_index = sorted_indices
        token_id = (torch.arange(sorted_indices.numel(), device=dev) // max(topk, 1)).to(torch.int32)
        row_probs = None
        if probs is not None:
            row_probs = torch.zeros(sorted_indices.numel(), dtype=probs.dtype, device=dev)
            expert, token = _rows(routing_map)
            row_probs[: token.numel()] = probs[token, expert]
    valid = out_index >= 0  # -1: an unused slot
    rows, toks = out_index[valid].long(), token_id[valid].long()
    x = permuted_tokens.float()[rows]
    if row_probs is not None:
        x = x * row_probs.float()[rows].unsqueeze(1)
    out = torch.zeros(t, permuted_tokens.shape[1], dtype=torch.float32, device=dev).index_add_(0, toks, x)
    return out.to(permuted_tokens.dtype), out_index, token_id, row_probs


def npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, *, probs=None,
                                             routing_map=None, drop_and_pad=False):
    return _npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, probs=probs,
                                                     routing_map=routing_map, drop_and_pad=drop_and_pad)[0]


EMULATORS = {f.__name__: f for f in (
    npu_moe_token_permute_with_routing_map, npu_moe_token_unpermute_with_routing_map,
    _npu_moe_token_unpermute_with_routing_map)}
