"""MoE token permute / unpermute with Megatron-Core's contract (`moe_utils.permute/unpermute`).

`moe_permute(tokens, routing_map, probs)` groups the token rows by expert (tokens ascending
within an expert) and returns (permuted, permuted_probs, sorted_indices, tokens_per_expert);
`moe_unpermute(permuted, sorted_indices, num_tokens, probs, routing_map)` sums each token's
rows back, weighted by its probabilities when `probs` is given.

CPU: `npuspeed::moe_permute` / `moe_unpermute` (csrc/cpu/moe_permute.cpp, a counting sort and
an atomic-free reduction; no [tokens x experts] temporary). NPU: torch_npu's
`npu_moe_token_permute_with_routing_map` / `npu_moe_token_unpermute_with_routing_map`, whose
sorted_indices have torch_npu's own meaning (only ever handed back to the NPU unpermute).
Elsewhere: the references below, which are Megatron's unfused algorithm.
"""
from __future__ import annotations

import torch

from npuspeed.ops import _dispatch
from npuspeed.ops._extension import has_op
from npuspeed.ops.npu import moe as npu_moe
from npuspeed.ops.npu.moe import NPU_PERMUTE, NPU_UNPERMUTE  # noqa: F401  (their names, re-exported)

OP = "moe_permute"


def permute_reference(tokens, routing_map):
    """Megatron's unfused permute (it transposes the map into a dense [E, T] copy)."""
    num_tokens, num_experts = routing_map.shape
    mask = routing_map.bool().T.contiguous()
    token_ids = torch.arange(num_tokens, device=tokens.device).unsqueeze(0).expand(num_experts, -1)
    sorted_indices = token_ids.masked_select(mask)
    return tokens.index_select(0, sorted_indices), sorted_indices, routing_map.sum(dim=0).long()


def unpermute_reference(permuted, sorted_indices, row_probs, num_tokens):
    """Megatron's unfused unpermute: weight, scatter-add in the weighted dtype, cast back."""
    x = permuted if row_probs is None else permuted * row_probs.unsqueeze(-1)
    out = torch.zeros(num_tokens, permuted.shape[1], dtype=x.dtype, device=x.device)
    out.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, permuted.shape[1]), x)
    return out.to(permuted.dtype)


def _row_experts(tokens_per_expert: torch.Tensor, device) -> torch.Tensor:
    """Expert of each permuted row, [N] (rows are grouped by expert)."""
    experts = torch.arange(tokens_per_expert.numel(), device=device)
    return torch.repeat_interleave(experts, tokens_per_expert.to(device))


def _register() -> None:
    def permute_setup(ctx, inputs, output):
        tokens, _ = inputs
        _, sorted_indices, tokens_per_expert = output
        ctx.save_for_backward(sorted_indices)
        ctx.num_tokens = tokens.shape[0]
        ctx.mark_non_differentiable(sorted_indices, tokens_per_expert)

    def permute_backward(ctx, grad, _g_idx, _g_tpe):
        (sorted_indices,) = ctx.saved_tensors
        return torch.ops.npuspeed.moe_unpermute(grad, sorted_indices, None, ctx.num_tokens), None

    torch.library.register_autograd("npuspeed::moe_permute", permute_backward, setup_context=permute_setup)

    def unpermute_setup(ctx, inputs, output):
        permuted, sorted_indices, row_probs, _ = inputs
        ctx.probs_grad = row_probs is not None and row_probs.requires_grad
        ctx.save_for_backward(sorted_indices, row_probs, permuted if ctx.probs_grad else None)

    def unpermute_backward(ctx, grad):
        sorted_indices, row_probs, permuted = ctx.saved_tensors
        dx, dp = torch.ops.npuspeed.moe_unpermute_backward(grad, sorted_indices, row_probs, permuted,
                                                           ctx.probs_grad)
        return dx, None, (dp if ctx.probs_grad else None), None

    torch.library.register_autograd("npuspeed::moe_unpermute", unpermute_backward, setup_context=unpermute_setup)

    @torch.library.register_fake("npuspeed::moe_permute")
    def _fake_permute(tokens, routing_map):
        rows = torch.library.get_ctx().new_dynamic_size()
        return (tokens.new_empty(rows, tokens.shape[1]), tokens.new_empty(rows, dtype=torch.long),
                tokens.new_empty(routing_map.shape[1], dtype=torch.long))

    @torch.library.register_fake("npuspeed::moe_unpermute")
    def _fake_unpermute(permuted, sorted_indices, row_probs, num_tokens):
        return permuted.new_empty(num_tokens, permuted.shape[1])

    @torch.library.register_fake("npuspeed::moe_unpermute_backward")
    def _fake_unpermute_bwd(grad, sorted_indices, row_probs, permuted, probs_grad):
        rows = sorted_indices.shape[0]
        return grad.new_empty(rows, grad.shape[1]), grad.new_empty(rows if probs_grad else 0, dtype=torch.float32)


def implementation(tokens: torch.Tensor) -> str:
    """npu, cpp or reference, for tokens on this device and of this dtype."""
    if _dispatch.on_npu(tokens):
        return _dispatch.NPU_IMPL if npu_moe.has_permute() else "reference"
    if _dispatch.on_host(tokens) and tokens.dtype in _dispatch.CPP_DTYPES and has_op(OP):
        return "cpp"
    return "reference"


def npu_accepts(routing_map, num_out_tokens=None, drop_and_pad=False, tokens=None, probs=None) -> bool:
    """Whether torch_npu's permute takes this routing map. Outside drop_and_pad mode its
    documentation requires every row to select the same number of experts ("非drop_and_pad模式要求
    每行中为1或true的个数固定（记为topK）"), topK < 512, and num_out_tokens // tokens_num == topK.
    Megatron's all-gather dispatcher passes the map cut to this rank's experts, whose rows vary
    at EP > 1 (and a capacity factor drops tokens): then the portable path runs. One reduction
    and one host sync per call. num_out_tokens None (torch_npu reads topK 1) is accepted for
    any equal row count: moe_permute then passes the count it implies. probs must have the
    tokens' dtype, or be fp32 with bf16 tokens (its documentation: fp16 tokens with a router's
    fp32 probs are not taken)."""
    if probs is not None and tokens is not None and probs.dtype != tokens.dtype \
            and not (probs.dtype == torch.float32 and tokens.dtype == torch.bfloat16):
        return False
    if drop_and_pad or routing_map.shape[0] == 0:
        return True
    low, high = torch.stack(torch.aminmax(routing_map.sum(dim=1))).tolist()
    top_k = high if num_out_tokens is None else int(num_out_tokens) // routing_map.shape[0]
    return low == high == top_k and high < 512


def moe_permute(tokens, routing_map, probs=None, *, num_out_tokens=None, drop_and_pad=False, checked=False):
    """(permuted [N, H], permuted_probs [N] or None, sorted_indices [N], tokens_per_expert [E]).
    `checked`: the caller already knows npu_accepts() holds (no second host sync)."""
    impl = implementation(tokens)
    if impl == _dispatch.NPU_IMPL and not checked and not npu_accepts(routing_map, num_out_tokens, drop_and_pad, tokens, probs):
        impl = "reference"  # rows of different expert counts: not torch_npu's contract
    _dispatch.record(OP, impl)
    if impl == _dispatch.NPU_IMPL:
        if num_out_tokens is None and not drop_and_pad:  # torch_npu would read it as topK 1
            num_out_tokens = int(routing_map.sum())
        permuted, permuted_probs, sorted_indices = npu_moe.permute(tokens, routing_map, probs, num_out_tokens,
                                                                   drop_and_pad)
        return permuted, permuted_probs, sorted_indices, routing_map.sum(dim=0).long()
    if impl == "cpp":
        _dispatch.ensure_registered(OP, _register)
        permuted, sorted_indices, tokens_per_expert = torch.ops.npuspeed.moe_permute(tokens, routing_map)
    else:
        permuted, sorted_indices, tokens_per_expert = permute_reference(tokens, routing_map)
    permuted_probs = None
    if probs is not None:  # [N] gathered by (token, expert of the row): no [T, E] temporary
        permuted_probs = probs[sorted_indices, _row_experts(tokens_per_expert, probs.device)]
    return permuted, permuted_probs, sorted_indices, tokens_per_expert


def moe_unpermute(permuted, sorted_indices, num_tokens: int, probs=None, routing_map=None, *, drop_and_pad=False):
    """[num_tokens, H]: each token's rows summed (weighted by `probs` [T, E] when given)."""
    if probs is not None and routing_map is None:
        raise ValueError("moe_unpermute: weighting by probs needs the routing_map that permuted the tokens")
    impl = implementation(permuted)
    if impl == _dispatch.NPU_IMPL and sorted_indices.dtype != torch.int32:
        impl = "reference"  # torch_npu's sorted_indices are int32: these came from the reference permute
    _dispatch.record("moe_unpermute", impl)
    if impl == _dispatch.NPU_IMPL:
        return npu_moe.unpermute(permuted, sorted_indices, num_tokens, probs, routing_map, drop_and_pad)
    row_probs = None
    if probs is not None:
        row_probs = probs[sorted_indices, _row_experts(routing_map.sum(dim=0), probs.device)]
    if impl == "cpp":
        _dispatch.ensure_registered(OP, _register)
        return torch.ops.npuspeed.moe_unpermute(permuted, sorted_indices, row_probs, int(num_tokens))
    return unpermute_reference(permuted, sorted_indices, row_probs, int(num_tokens))
