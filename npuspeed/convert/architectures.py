"""Which Hugging Face architectures convert, and the Megatron model each `config.json` describes.

A config field that changes the maths and that the local-spec GPTModel cannot reproduce
(a RoPE scaling kind, a sliding attention window, biases Megatron would put elsewhere) is
refused with one line naming it: a converted model that computes something else is worse
than none. Fields that only matter for generation or for the Python class are ignored.
"""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class Experts:
    """The mixture of experts of every layer: E experts of FFN width `ffn_hidden_size`, top-k
    routing; `pre_softmax`: softmax over all experts, then top-k, no renormalisation."""

    num_experts: int
    ffn_hidden_size: int
    topk: int
    pre_softmax: bool
    aux_loss_coeff: float
    shared_ffn_hidden_size: int | None = None  # one shared expert every token goes through (Qwen2-MoE)
    shared_gate: bool = False  # its output scaled by sigmoid(x . w), w of shape [1, hidden]
    score_function: str = "softmax"  # DeepSeek-V3: "sigmoid"
    expert_bias: bool = False  # V3's e_score_correction_bias, added to the scores for choosing only
    scaling_factor: float | None = None  # routed_scaling_factor: the chosen weights times this
    num_groups: int | None = None  # group-limited routing: experts in groups, the best group_topk groups
    group_topk: int | None = None
    dense_layers: int = 0  # DeepSeek's first_k_dense_replace: the first layers have a plain MLP


@dataclass(frozen=True)
class MLA:
    """Multi-latent attention's sizes (DeepSeek-V2/V3); `q_lora_rank` None: one query projection.
    `hf_rope_interleaved`: the Hugging Face rotary dimensions come in pairs (x0, x1), (x2, x3), as
    Megatron's MLA takes them; False (V3's rope_interleave false): halves, rows permuted here."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int  # qk_nope_head_dim
    qk_pos_emb_head_dim: int  # qk_rope_head_dim
    v_head_dim: int
    hf_rope_interleaved: bool
    yarn_factor: float | None = None  # YaRN on the RoPE part (None: plain RoPE), with its two mscales
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class ModelSpec:
    """What the Megatron model needs to know about a Hugging Face model (global sizes)."""

    architecture: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    max_position_embeddings: int
    norm_epsilon: float
    rotary_base: float
    rope_scaling_factor: float | None
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    experts: Experts | None = None
    attention_dropout: float = 0.0
    mla: MLA | None = None  # training only; these models have no other dropout

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


def _refuse(arch: str, field: str, value, why: str) -> UserError:
    return UserError(f"{arch}: config.json field {field}={value!r} is not converted ({why}); a Megatron "
                     "local-spec model would compute something else")


#: Llama 3.x's RoPE scaling as Megatron's RotaryEmbedding applies it: only the factor is a
#: parameter there, the other three are fixed at these values
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope(arch: str, cfg: dict) -> tuple[float, float | None]:
    """RoPE's base and Llama 3's scaling factor (None: plain RoPE); transformers 5 keeps both
    in rope_parameters, earlier releases in rope_theta and rope_scaling."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    where = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    kind = params.get("rope_type") or params.get("type") or "default"
    factor = None
    if kind == "llama3":
        for field, value in LLAMA3_FIXED.items():
            if float(params.get(field, -1)) != value:
                raise _refuse(arch, f"{where}.{field}", params.get(field),
                              f"Megatron's Llama 3 RoPE scaling fixes it at {value:g}")
        factor = float(params["factor"])
    elif kind != "default":
        raise _refuse(arch, f"{where}.rope_type", kind, "plain RoPE and Llama 3's scaling are mapped so far")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))), factor


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
