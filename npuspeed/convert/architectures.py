"""Which Hugging Face architectures convert, and the Megatron model each `config.json` describes.

A config field that changes the maths and that the local-spec GPTModel cannot reproduce
(a RoPE scaling kind, a sliding attention window, biases Megatron would put elsewhere) is
refused with one line naming it: a converted model that computes something else is worse
than none. Fields that only matter for generation or for the Python class are ignored.
"""
from __future__ import annotations

from npuspeed.convert.model_spec import Experts, ModelSpec, refuse as _refuse, rope as _rope
from npuspeed.errors import UserError

#: architecture -> (QKV bias, per-head query/key norm): the dense Llama family
DENSE = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
#: the same attention with every MLP a mixture of experts (routed experts only)
MOE = {
    "MixtralForCausalLM": (False, False),
    "Qwen2MoeForCausalLM": (True, False),
    "Qwen3MoeForCausalLM": (False, True),
}
#: multi-latent attention and DeepSeek's routing (npuspeed/convert/deepseek.py)
DEEPSEEK = {"DeepseekV2ForCausalLM": (False, False), "DeepseekV3ForCausalLM": (False, False)}
SUPPORTED = {**DENSE, **MOE, **DEEPSEEK}


def _check_plain(arch: str, cfg: dict) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse(arch, "hidden_act", act, "Megatron's SwiGLU is SiLU-gated")
    for field in ("attention_bias", "mlp_bias"):
        if cfg.get(field) and not (arch == "Qwen2ForCausalLM"):
            raise _refuse(arch, field, True, "Megatron's --add-bias-linear puts biases on every linear layer")
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window")  # Mistral, Mixtral: no switch, a window is used when set
    if (uses_window is None or uses_window) and window is not None:
        raise _refuse(arch, "sliding_window", window, "Megatron's local attention attends to every earlier token")
    if (cfg.get("partial_rotary_factor") or 1.0) != 1.0:
        raise _refuse(arch, "partial_rotary_factor", cfg["partial_rotary_factor"], "not mapped so far")
    if cfg.get("pretraining_tp", 1) != 1:
        raise _refuse(arch, "pretraining_tp", cfg["pretraining_tp"], "its sliced matmuls are not mapped")


def from_hf_config(cfg: dict) -> ModelSpec:
    """The ModelSpec of a Hugging Face config.json (a dict), or UserError naming what does not map."""
    archs = cfg.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED:
        raise UserError(f"config.json architectures={archs!r}: not convertible (supported: "
                        f"{', '.join(SUPPORTED)})")
    arch = archs[0]
    if arch in DEEPSEEK:
        from npuspeed.convert import deepseek

        return deepseek.from_hf_config(arch, cfg)
    qkv_bias, qk_norm = SUPPORTED[arch]
    _check_plain(arch, cfg)
    heads = int(cfg["num_attention_heads"])
    groups = int(cfg.get("num_key_value_heads") or heads)
    if heads % groups:
        raise _refuse(arch, "num_key_value_heads", groups, f"it does not divide num_attention_heads={heads}")
    hidden = int(cfg["hidden_size"])
    theta, rope_factor = _rope(arch, cfg)
    return ModelSpec(
        architecture=arch,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        rotary_base=theta,
        rope_scaling_factor=rope_factor,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        experts=_experts(arch, cfg) if arch in MOE else None,
        attention_dropout=float(cfg.get("attention_dropout") or 0.0),
    )


def _experts(arch: str, cfg: dict) -> Experts:
    if (cfg.get("router_jitter_noise") or 0.0) != 0.0:
        raise _refuse(arch, "router_jitter_noise", cfg["router_jitter_noise"], "not mapped so far")
    if arch == "MixtralForCausalLM":  # softmax, top-k, renormalised: Megatron's top-k then softmax
        return Experts(int(cfg["num_local_experts"]), int(cfg["intermediate_size"]),
                       int(cfg["num_experts_per_tok"]), False, float(cfg.get("router_aux_loss_coef") or 0.0))
    if int(cfg.get("decoder_sparse_step") or 1) != 1 or cfg.get("mlp_only_layers"):
        field = "mlp_only_layers" if cfg.get("mlp_only_layers") else "decoder_sparse_step"
        raise _refuse(arch, field, cfg.get(field), "dense layers between MoE layers are not mapped so far")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) or None
    return Experts(int(cfg.get("num_experts") or cfg["num_local_experts"]), int(cfg["moe_intermediate_size"]),
                   int(cfg["num_experts_per_tok"]), not cfg.get("norm_topk_prob", False),
                   float(cfg.get("router_aux_loss_coef") or 0.0), shared, shared is not None)


def check_layout(spec: ModelSpec, tp: int, pp: int, vpp_layers: int | None, ep: int, etp: int | None = None) -> None:
    """The layout's flags against the model: one line for the first that cannot take it."""
    flag = "--tensor-model-parallel-size"
    counts = [("attention heads", spec.num_attention_heads), ("key/value heads", spec.num_query_groups)]
    if spec.experts is None or spec.experts.dense_layers:
        counts.append(("FFN width (intermediate_size)", spec.ffn_hidden_size))
    if spec.experts is not None and spec.experts.shared_ffn_hidden_size:
        counts.append(("shared experts' FFN width", spec.experts.shared_ffn_hidden_size))
    if spec.mla is not None:  # megatron-core 0.16's local spec splits the down projections over TP too
        counts += [("q_lora_rank", spec.mla.q_lora_rank or tp),
                   ("rows of kv_a_proj_with_mqa", spec.mla.kv_lora_rank + spec.mla.qk_pos_emb_head_dim)]
    for what, count in counts:
        if count % tp:
            raise UserError(f"{flag} {tp}: the model's {count} {what} do not split over {tp} ranks; "
                            f"pick a size that divides {count}")
    if spec.num_layers % pp:
        raise UserError(f"--pipeline-model-parallel-size {pp}: the model's {spec.num_layers} layers do not "
                        f"split into {pp} stages; pick a size that divides {spec.num_layers}")
    if vpp_layers and (spec.num_layers // pp) % vpp_layers:
        raise UserError(f"--num-layers-per-virtual-pipeline-stage {vpp_layers}: does not divide the "
                        f"{spec.num_layers // pp} layers of each pipeline stage")
    experts = spec.experts
    if experts is None:
        if ep != 1:
            raise UserError(f"--expert-model-parallel-size {ep}: {spec.architecture} has no experts; drop the flag")
        return
    if experts.num_experts % ep:
        raise UserError(f"--expert-model-parallel-size {ep}: the model's {experts.num_experts} experts do not split "
                        f"over {ep} ranks; pick a size that divides {experts.num_experts}")
    etp = etp or tp
    if experts.ffn_hidden_size % etp:
        raise UserError(f"--expert-tensor-parallel-size {etp}: the experts' FFN width {experts.ffn_hidden_size} "
                        f"does not split over {etp} ranks")
