"""What a converted model is (ModelSpec, its experts and multi-latent attention) and the
config.json readings every architecture shares (a refusal line, RoPE's base and scaling): kept
apart from architectures.py so the DeepSeek mapping (deepseek.py), which architectures.py
calls, can use them without importing it back.
"""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.errors import UserError


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


def refuse(arch: str, field: str, value, why: str) -> UserError:
    return UserError(f"{arch}: config.json field {field}={value!r} is not converted ({why}); a Megatron "
                     "local-spec model would compute something else")


#: Llama 3.x's RoPE scaling as Megatron's RotaryEmbedding applies it: only the factor is a
#: parameter there, the other three are fixed at these values
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope(arch: str, cfg: dict) -> tuple[float, float | None]:
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
                raise refuse(arch, f"{where}.{field}", params.get(field),
                              f"Megatron's Llama 3 RoPE scaling fixes it at {value:g}")
        factor = float(params["factor"])
    elif kind != "default":
        raise refuse(arch, f"{where}.rope_type", kind, "plain RoPE and Llama 3's scaling are mapped so far")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))), factor
