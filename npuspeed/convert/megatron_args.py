"""The Megatron-LM command-line flags that describe a converted model, and the example's
record of them in a checkpoint.

A user copies these flags instead of guessing them: a wrong --norm-epsilon or --rotary-base
still loads every tensor and silently trains another model. The same values, as the
example's argument names, go into the checkpoint's run description, which the example
compares with its own flags before it reads a tensor (gpt_example/ckpt_verify.py).
"""
from __future__ import annotations

from npuspeed.convert.model_spec import ModelSpec


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def model_flags(spec: ModelSpec, divisible_by: int) -> list[str]:
    """Megatron-LM flags of the model (the layout and precision flags come on top)."""
    flags = ["--num-layers", str(spec.num_layers), "--hidden-size", str(spec.hidden_size),
             "--ffn-hidden-size", str(spec.ffn_hidden_size), "--num-attention-heads", str(spec.num_attention_heads)]
    if spec.num_query_groups != spec.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(spec.num_query_groups)]
    if spec.mla is not None:
        flags += _mla_flags(spec)
    elif spec.kv_channels * spec.num_attention_heads != spec.hidden_size:
        flags += ["--kv-channels", str(spec.kv_channels)]
    flags += ["--max-position-embeddings", str(spec.max_position_embeddings),
              "--normalization", "RMSNorm", "--norm-epsilon", repr(spec.norm_epsilon), "--swiglu",
              "--position-embedding-type", "rope", "--rotary-base", _number(spec.rotary_base),
              "--disable-bias-linear", "--hidden-dropout", "0",
              "--attention-dropout", _number(spec.attention_dropout),
              "--make-vocab-size-divisible-by", str(divisible_by), "--transformer-impl", "local"]
    if spec.rope_scaling_factor is not None:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", _number(spec.rope_scaling_factor)]
    if spec.qkv_bias:
        flags.append("--add-qkv-bias")
    if spec.qk_norm:
        flags.append("--qk-layernorm")
    if not spec.tied_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    experts = spec.experts
    if experts is not None:
        flags += ["--num-experts", str(experts.num_experts), "--moe-router-topk", str(experts.topk),
                  "--moe-ffn-hidden-size", str(experts.ffn_hidden_size),
                  "--moe-aux-loss-coeff", repr(experts.aux_loss_coeff)]
        if experts.pre_softmax:
            flags.append("--moe-router-pre-softmax")
        if experts.shared_ffn_hidden_size:
            flags += ["--moe-shared-expert-intermediate-size", str(experts.shared_ffn_hidden_size)]
        if experts.shared_gate:
            flags.append("--moe-shared-expert-gate")
        flags += _routing_flags(spec)
    return flags


def _mla_flags(spec: ModelSpec) -> list[str]:
    """Multi-latent attention (Megatron-LM's names); --qk-layernorm gives the local spec its
    q/kv latent norms; --rope-type always (MLA's default would be YaRN)."""
    m = spec.mla
    flags = ["--multi-latent-attention"]
    if m.q_lora_rank is not None:
        flags += ["--q-lora-rank", str(m.q_lora_rank)]
    return flags + ["--kv-lora-rank", str(m.kv_lora_rank), "--qk-head-dim", str(m.qk_head_dim),
                    "--qk-pos-emb-head-dim", str(m.qk_pos_emb_head_dim), "--v-head-dim", str(m.v_head_dim),
                    "--qk-layernorm", *_mla_rope_flags(m)]


def _mla_rope_flags(m) -> list[str]:
    if m.yarn_factor is None:  # Megatron refuses RoPE fusion with MLA's plain RoPE (YaRN only)
        return ["--rope-type", "rope", "--no-rope-fusion"]
    return ["--rope-type", "yarn", "--rotary-scaling-factor", _number(m.yarn_factor), "--mscale",
            _number(m.yarn_mscale), "--mscale-all-dim", _number(m.yarn_mscale_all_dim)]


def _routing_flags(spec: ModelSpec) -> list[str]:
    """DeepSeek's routing and dense first layers (--moe-layer-freq: Megatron-LM's list pattern)."""
    e, flags = spec.experts, []
    if e.score_function != "softmax":
        flags += ["--moe-router-score-function", e.score_function]
    if e.expert_bias:
        flags.append("--moe-router-enable-expert-bias")
    if e.scaling_factor is not None:
        flags += ["--moe-router-topk-scaling-factor", _number(e.scaling_factor)]
    if e.num_groups is not None:
        flags += ["--moe-router-num-groups", str(e.num_groups), "--moe-router-group-topk", str(e.group_topk)]
    if e.dense_layers:
        flags += ["--moe-layer-freq", f"[0]*{e.dense_layers}+[1]*{spec.num_layers - e.dense_layers}"]
    return flags


def fingerprint(spec: ModelSpec, padded_vocab: int) -> dict:
    """The example's model description (ckpt_verify.MODEL_FLAGS) of a run with `model_flags`."""
    explicit_kv = spec.mla is None and spec.kv_channels * spec.num_attention_heads != spec.hidden_size
    m, e = spec.mla, spec.experts
    dense = e.dense_layers if e else 0
    return {
        "multi_latent_attention": m is not None, "q_lora_rank": m.q_lora_rank if m else None,
        "kv_lora_rank": m.kv_lora_rank if m else None, "qk_head_dim": m.qk_head_dim if m else None,
        "qk_pos_emb_head_dim": m.qk_pos_emb_head_dim if m else None, "v_head_dim": m.v_head_dim if m else None,
        "moe_layer_freq": [0] * dense + [1] * (spec.num_layers - dense) if dense else 1,
        "moe_router_enable_expert_bias": bool(e and e.expert_bias),
        "num_layers": spec.num_layers, "hidden_size": spec.hidden_size, "ffn_hidden_size": spec.ffn_hidden_size,
        "num_attention_heads": spec.num_attention_heads, "num_query_groups": spec.num_query_groups,
        "kv_channels": spec.kv_channels if explicit_kv else None, "padded_vocab_size": padded_vocab,
        "max_position_embeddings": spec.max_position_embeddings, "normalization": "RMSNorm", "swiglu": True,
        "position_embedding_type": "rope", "untie_embeddings_and_output_weights": not spec.tied_embeddings,
        "disable_bias_linear": True, "num_experts": spec.experts.num_experts if spec.experts else None,
        "moe_ffn_hidden_size": spec.experts.ffn_hidden_size if spec.experts else None,
        "add_qkv_bias": spec.qkv_bias, "qk_layernorm": spec.qk_norm or spec.mla is not None,  # MLA: latent norms
        "moe_shared_expert_intermediate_size": spec.experts.shared_ffn_hidden_size if spec.experts else None,
        "moe_shared_expert_gate": bool(spec.experts and spec.experts.shared_gate),
    }


def layout_flags(tp: int, pp: int, vpp_layers: int | None, precision: str, ep: int = 1,
                 etp: int | None = None) -> list[str]:
    flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if ep != 1:
        flags += ["--expert-model-parallel-size", str(ep)]
    if etp is not None:
        flags += ["--expert-tensor-parallel-size", str(etp)]
    if vpp_layers:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(vpp_layers)]
    if precision != "fp32":
        flags.append("--" + precision)
    return flags
