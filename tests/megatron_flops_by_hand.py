"""Megatron-LM's model-FLOPs formula evaluated by hand, for the TFLOP/s tests (unit and e2e)."""
from __future__ import annotations


def megatron_by_hand(a, batch_size):
    """Megatron-LM core_v0.16.1 `num_floating_point_operations` (standard Transformer, no MTP,
    no MLA), written term by term with its argument names, as a reader checks it on paper."""
    groups = a.num_query_groups if a.group_query_attention else a.num_attention_heads
    if a.num_experts is None:
        dense, moe, topk = a.num_layers, 0, 0
    else:
        pattern = [1 if i % a.moe_layer_freq == 0 else 0 for i in range(a.num_layers)] \
            if isinstance(a.moe_layer_freq, int) else a.moe_layer_freq
        moe = sum(pattern)
        dense, topk = a.num_layers - moe, a.moe_router_topk
    moe_ffn = a.moe_ffn_hidden_size if a.moe_ffn_hidden_size is not None else a.ffn_hidden_size
    shared = a.moe_shared_expert_intermediate_size or 0
    ffn_factor = 3 if a.swiglu else 2
    q = a.kv_channels * a.num_attention_heads
    k = v = a.kv_channels * groups
    attn = 3 * 2 * (a.hidden_size * (q + k + v) + q * a.seq_length / 2 * 2 + q * a.hidden_size)
    mlp = 3 * 2 * a.hidden_size * (a.ffn_hidden_size * ffn_factor * dense + moe_ffn * topk * ffn_factor * moe
                                   + shared * ffn_factor * moe)
    logits = 3 * 2 * a.hidden_size * a.padded_vocab_size
    return batch_size * a.seq_length * (mlp + attn * a.num_layers + logits)


def megatron_args(**given):
    """A Megatron-LM argument namespace (after its validate_args) with only what the formula reads."""
    import argparse

    a = dict(num_layers=2, hidden_size=64, ffn_hidden_size=None, num_attention_heads=4, group_query_attention=False,
             num_query_groups=None, kv_channels=None, seq_length=64, padded_vocab_size=None, swiglu=False,
             num_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None,
             moe_shared_expert_intermediate_size=None, moe_layer_freq=1)
    a.update(given)
    a["ffn_hidden_size"] = a["ffn_hidden_size"] or 4 * a["hidden_size"]
    a["kv_channels"] = a["kv_channels"] or a["hidden_size"] // a["num_attention_heads"]
    return argparse.Namespace(**a)
