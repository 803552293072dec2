"""torch_npu's MoE kernels: the routing-map token permute/unpermute pair and the grouped matmul."""
from __future__ import annotations

import sys

from npuspeed.ops.npu import library

NPU_PERMUTE = "npu_moe_token_permute_with_routing_map"
NPU_UNPERMUTE = "npu_moe_token_unpermute_with_routing_map"


def has_permute() -> bool:
    """Whether the loaded torch_npu has the routing-map permute (2.9.0 on)."""
    return hasattr(library(), NPU_PERMUTE)


def permute(tokens, routing_map, probs, num_out_tokens, drop_and_pad: bool):
    """(permuted, permuted_probs, sorted_indices [int32, torch_npu's own meaning])."""
    return library().npu_moe_token_permute_with_routing_map(
        tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, drop_and_pad=drop_and_pad)


def unpermute(permuted, sorted_indices, num_tokens: int, probs, routing_map, drop_and_pad: bool):
    """[num_tokens, H]: each token's rows summed (weighted by probs)."""
    return library().npu_moe_token_unpermute_with_routing_map(
        permuted, sorted_indices, [num_tokens, permuted.shape[1]], probs=probs, routing_map=routing_map,
        drop_and_pad=drop_and_pad)


def has_grouped_matmul() -> bool:
    """Whether torch_npu is loaded and has npu_grouped_matmul."""
    return hasattr(sys.modules.get("torch_npu"), "npu_grouped_matmul")


def grouped_matmul(x, w, group_list):
    """[M, N]: npu_grouped_matmul with m-axis groups of `group_list` rows (counts, not offsets)
    and one output tensor (split_item 3)."""
    return library().npu_grouped_matmul([x], [w], group_list=group_list, split_item=3, group_type=0,
                                        group_list_type=1)[0]
