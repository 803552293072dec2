"""The Megatron flags npuspeed reads, parsed from the same argv as npuspeed's own.

Features need a few of Megatron's choices before Megatron parses anything (is it bf16? what
TP size? which normalization?). They get them here, from the argv given to
`runtime.initialize(argv)` (the command line plus NPUSPEED_ARGS), never from `sys.argv`
behind the caller's back. A flag that is not on the command line is None: "not said", which
a feature must not read as Megatron's default, because a megatron.core script may set the
same thing in code. This module imports nothing from npuspeed.
"""
from __future__ import annotations

import argparse

#: dest -> (flag, argparse keyword arguments); booleans are store_const True (None = not given).
FLAGS: dict[str, tuple[str, dict]] = {
    "bf16": ("--bf16", {"action": "store_const", "const": True}),
    "fp16": ("--fp16", {"action": "store_const", "const": True}),
    "tensor_model_parallel_size": ("--tensor-model-parallel-size", {"type": int}),
    "pipeline_model_parallel_size": ("--pipeline-model-parallel-size", {"type": int}),
    "context_parallel_size": ("--context-parallel-size", {"type": int}),
    "num_layers_per_virtual_pipeline_stage": ("--num-layers-per-virtual-pipeline-stage", {"type": int}),
    "virtual_pipeline_model_parallel_size": ("--virtual-pipeline-model-parallel-size", {"type": int}),
    "global_batch_size": ("--global-batch-size", {"type": int}),
    "micro_batch_size": ("--micro-batch-size", {"type": int}),
    "expert_model_parallel_size": ("--expert-model-parallel-size", {"type": int}),
    "sequence_parallel": ("--sequence-parallel", {"action": "store_const", "const": True}),
    "normalization": ("--normalization", {"type": str}),
    "swiglu": ("--swiglu", {"action": "store_const", "const": True}),
    "position_embedding_type": ("--position-embedding-type", {"type": str}),
    "transformer_impl": ("--transformer-impl", {"type": str}),
    "num_experts": ("--num-experts", {"type": int}),
    "num_attention_heads": ("--num-attention-heads", {"type": int}),
    "num_query_groups": ("--num-query-groups", {"type": int}),
    "seq_length": ("--seq-length", {"type": int}),
    "attention_dropout": ("--attention-dropout", {"type": float}),
    # MoE layout (npuspeed/features/moe_common/layout.py)
    "expert_tensor_parallel_size": ("--expert-tensor-parallel-size", {"type": int}),
    "ffn_hidden_size": ("--ffn-hidden-size", {"type": int}),
    "moe_ffn_hidden_size": ("--moe-ffn-hidden-size", {"type": int}),
    "disable_bias_linear": ("--disable-bias-linear", {"action": "store_const", "const": True}),
    "moe_token_dispatcher_type": ("--moe-token-dispatcher-type", {"type": str}),
    "moe_shared_expert_overlap": ("--moe-shared-expert-overlap", {"action": "store_const", "const": True}),
    "moe_expert_capacity_factor": ("--moe-expert-capacity-factor", {"type": float}),
    "moe_pad_expert_input_to_capacity": ("--moe-pad-expert-input-to-capacity",
                                         {"action": "store_const", "const": True}),
    "cp_comm_type": ("--cp-comm-type", {"type": str, "nargs": "+"}),
    "hierarchical_context_parallel_sizes": ("--hierarchical-context-parallel-sizes", {"type": int, "nargs": "+"}),
    "reset_attention_mask": ("--reset-attention-mask", {"action": "store_const", "const": True}),
    # Megatron's own features that overlap npuspeed's (npuspeed/features/upstream_flags.py);
    # some exist only in newer releases: read here whatever the installed one knows
    "recompute_granularity": ("--recompute-granularity", {"type": str}),
    "recompute_modules": ("--recompute-modules", {"type": str, "nargs": "*"}),
    "overlap_moe_expert_parallel_comm": ("--overlap-moe-expert-parallel-comm",
                                         {"action": "store_const", "const": True}),
    "fine_grained_activation_offloading": ("--fine-grained-activation-offloading",
                                           {"action": "store_const", "const": True}),
    "optimizer": ("--optimizer", {"type": str}),
    "pipeline_model_parallel_layout": ("--pipeline-model-parallel-layout", {"type": str}),
    "enable_cuda_graph": ("--enable-cuda-graph", {"action": "store_const", "const": True}),
    "external_cuda_graph": ("--external-cuda-graph", {"action": "store_const", "const": True}),
    "cuda_graph_impl": ("--cuda-graph-impl", {"type": str}),
    "tensor_parallel_num_weight_shards": ("--tensor-parallel-num-weight-shards", {"type": int}),
    "expert_tensor_parallel_num_weight_shards": ("--expert-tensor-parallel-num-weight-shards", {"type": int}),
    # DualPipeV's V placement (npuspeed/features/dualpipev/dualpipev_feature.py)
    "num_layers": ("--num-layers", {"type": int}),
    "untie_embeddings_and_output_weights": ("--untie-embeddings-and-output-weights",
                                            {"action": "store_const", "const": True}),
    "overlap_param_gather": ("--overlap-param-gather", {"action": "store_const", "const": True}),
    "mtp_num_layers": ("--mtp-num-layers", {"type": int}),
    "decoder_first_pipeline_num_layers": ("--decoder-first-pipeline-num-layers", {"type": int}),
    "decoder_last_pipeline_num_layers": ("--decoder-last-pipeline-num-layers", {"type": int}),
    "account_for_embedding_in_pipeline_split": ("--account-for-embedding-in-pipeline-split",
                                                {"action": "store_const", "const": True}),
    "account_for_loss_in_pipeline_split": ("--account-for-loss-in-pipeline-split",
                                           {"action": "store_const", "const": True}),
    # reproducible runs (npuspeed/features/device/determinism.py)
    "deterministic_mode": ("--deterministic-mode", {"action": "store_const", "const": True}),
}


def parse(argv: list[str]) -> argparse.Namespace:
    """Megatron's flags in `argv` that npuspeed reads; everything else is ignored."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for dest, (flag, kwargs) in FLAGS.items():
        parser.add_argument(flag, dest=dest, default=None, **kwargs)
    return parser.parse_known_args(list(argv))[0]
