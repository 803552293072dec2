"""DeepSeek-V2/V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): multi-latent attention,
DeepSeek's routing, shared experts and dense first layers, on Megatron's local-spec MLA.

What maps (checked against transformers 5.24's forward, the reference of the logits tests):
- MLA: q_a_proj/q_a_layernorm/q_b_proj (or q_proj when q_lora_rank is null),
  kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj and o_proj are Megatron's linear_q_down_proj,
  q_layernorm, linear_q_up_proj (linear_q_proj), linear_kv_down_proj, kv_layernorm,
  linear_kv_up_proj and linear_proj, row for row: both lay a head out as [no-RoPE part; RoPE
  part] and the latent as [kv_lora_rank; RoPE part].
- RoPE: Megatron's MLA takes the rotary dimensions as pairs (x0, x1), (x2, x3), ... (it splits
  even and odd ones), as DeepSeek-V2 (complex pairs) and V3 with rope_interleave=true do; V3
  with rope_interleave=false rotates halves (x_i, x_{i+d/2}), so the RoPE rows of the query and
  of kv_a_proj_with_mqa are permuted into pairs here (and back).
- Routing: V3 is sigmoid scores, e_score_correction_bias for choosing only (Megatron's
  expert_bias), the chosen weights renormalised, times routed_scaling_factor; V2 is softmax
  over all experts, top-k, no renormalisation, times routed_scaling_factor. Group-limited
  routing maps where Megatron ranks a group the way transformers does (see `_groups`).
- Shared experts (n_shared_experts x moe_intermediate_size, no gate); first_k_dense_replace
  dense layers (Megatron's --moe-layer-freq pattern).
- YaRN (the released configs' RoPE scaling) is Megatron's MLA YaRN (`_yarn`).
Everything else that would change the maths is refused with one line.
"""
from __future__ import annotations

import torch

from npuspeed.convert import names
from npuspeed.convert.model_spec import MLA, Experts, ModelSpec, refuse as _refuse, rope as _rope
from npuspeed.errors import UserError

#: how transformers ranks a group of experts for group-limited routing: the sum of its best k
#: scores (V2's group_limited_greedy: the best one; V3: the best two)
_GROUP_SCORE_TOP = {"DeepseekV2ForCausalLM": 1, "DeepseekV3ForCausalLM": 2}
#: the score function transformers' class hard-codes (DeepSeek's own configs name it scoring_func)
_SCORE = {"DeepseekV2ForCausalLM": "softmax", "DeepseekV3ForCausalLM": "sigmoid"}


def _check(arch: str, cfg: dict) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse(arch, "hidden_act", act, "Megatron's SwiGLU is SiLU-gated")
    for field in ("attention_bias", "mlp_bias"):
        if cfg.get(field):
            raise _refuse(arch, field, True, "Megatron's --add-bias-linear puts biases on every linear layer")
    if cfg.get("pretraining_tp", 1) not in (1, None):
        raise _refuse(arch, "pretraining_tp", cfg["pretraining_tp"], "its sliced matmuls are not mapped")
    if cfg.get("quantization_config"):
        raise _refuse(arch, "quantization_config", (cfg["quantization_config"] or {}).get("quant_method"),
                      "quantized weights: dequantize them to bf16 first")
    heads = int(cfg["num_attention_heads"])
    if int(cfg.get("num_key_value_heads") or heads) != heads:
        raise _refuse(arch, "num_key_value_heads", cfg["num_key_value_heads"],
                      f"multi-latent attention has a key per head ({heads})")
    if cfg.get("scoring_func", _SCORE[arch]) != _SCORE[arch]:
        raise _refuse(arch, "scoring_func", cfg["scoring_func"], f"transformers' {arch} scores with {_SCORE[arch]}")
    if int(cfg.get("moe_layer_freq") or 1) != 1:
        raise _refuse(arch, "moe_layer_freq", cfg["moe_layer_freq"],
                      "transformers makes every layer after first_k_dense_replace an MoE layer")


def _groups(arch: str, cfg: dict, experts: int, topk: int) -> tuple[int | None, int | None]:
    """(num_groups, group_topk) of Megatron's group-limited routing, None where every group stays."""
    if arch == "DeepseekV2ForCausalLM":
        method = cfg.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise _refuse(arch, "topk_method", method, "transformers' DeepseekV2 routes with greedy or "
                          "group_limited_greedy")
        if method == "greedy":
            return None, None
    groups = int(cfg.get("n_group") or 1)
    chosen = int(cfg.get("topk_group") or groups)
    if groups <= 1 or chosen >= groups:
        return None, None
    if experts % groups:
        raise _refuse(arch, "n_group", groups, f"it does not divide the {experts} routed experts")
    top = _GROUP_SCORE_TOP[arch]
    if topk // chosen != top:
        raise _refuse(arch, "topk_group", chosen, f"Megatron ranks a group by the sum of its best num_experts_per_tok"
                      f"//topk_group={topk // chosen} scores, transformers' {arch} by its best {top}")
    return groups, chosen


def _experts(arch: str, cfg: dict, layers: int) -> Experts:
    num = int(cfg["n_routed_experts"])
    topk = int(cfg["num_experts_per_tok"])
    dense = int(cfg.get("first_k_dense_replace") or 0)
    if dense >= layers:
        raise _refuse(arch, "first_k_dense_replace", dense, f"no MoE layer left of {layers}: not mapped")
    shared = int(cfg.get("n_shared_experts") or 0)
    if shared < 1:
        raise _refuse(arch, "n_shared_experts", cfg.get("n_shared_experts"), "a model without shared experts")
    norm = bool(cfg.get("norm_topk_prob"))
    sigmoid = _SCORE[arch] == "sigmoid"
    if sigmoid and norm != (topk > 1):  # Megatron's sigmoid routing renormalises exactly when top-k > 1
        raise _refuse(arch, "norm_topk_prob", norm, f"Megatron's sigmoid routing renormalises the chosen "
                      f"weights {'only when top-k > 1' if norm else 'when top-k > 1'}")
    if not sigmoid and norm:
        raise _refuse(arch, "norm_topk_prob", True, "transformers' DeepseekV2 ignores it and DeepSeek's own "
                      "code renormalises: which model is meant is not clear")
    groups, group_topk = _groups(arch, cfg, num, topk)
    scale = float(cfg.get("routed_scaling_factor") or 1.0)
    ffn = int(cfg["moe_intermediate_size"])
    aux = float(cfg.get("router_aux_loss_coef") or cfg.get("aux_loss_alpha") or 0.0)
    return Experts(num, ffn, topk, pre_softmax=not sigmoid, aux_loss_coeff=aux, shared_ffn_hidden_size=shared * ffn,
                   score_function=_SCORE[arch], expert_bias=sigmoid, scaling_factor=None if scale == 1.0 else scale,
                   num_groups=groups, group_topk=group_topk, dense_layers=dense)


#: YaRN settings Megatron-LM cannot pass to MLA (no flag in core_v0.16/0.19: MLATransformerConfig's
#: defaults), so a config converts only with these values (DeepSeek-V2's and V3's)
YARN_FIXED = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}


def _yarn(arch: str, cfg: dict) -> tuple[float, float | None, float, float]:
    """(rope base, YaRN factor or None, mscale, mscale_all_dim) as Megatron's MLA takes them.
    transformers scales cos/sin by m(f, mscale)/m(f, mscale_all_dim) when both are set, else by
    m(f, 1), and the softmax by m(f, mscale_all_dim)^2 when that is set; Megatron does the first
    and the last with its mscale and mscale_all_dim (0: no softmax scaling)."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    where = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    if (params.get("rope_type") or params.get("type")) != "yarn":
        theta, factor = _rope(arch, cfg)
        if factor is not None:
            raise _refuse(arch, f"{where}.rope_type", "llama3", "Megatron's MLA has plain RoPE and YaRN only")
        return theta, None, 1.0, 0.0
    for field, value in YARN_FIXED.items():
        got = params.get(field)
        if got is None or float(got) != value:
            raise _refuse(arch, f"{where}.{field}", got, f"Megatron-LM's MLA takes YaRN's {field} as {value:g} only")
    if params.get("attention_factor") is not None:
        raise _refuse(arch, f"{where}.attention_factor", params["attention_factor"], "not mapped to Megatron's YaRN")
    if params.get("truncate", True) is not True:  # Megatron's MLA rounds the correction range
        raise _refuse(arch, f"{where}.truncate", params["truncate"], "Megatron's MLA YaRN rounds the correction range")
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if all_dim and not mscale:
        raise _refuse(arch, f"{where}.mscale", mscale, "with mscale_all_dim set, Megatron's YaRN needs it")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return theta, float(params["factor"]), float(mscale) if all_dim else 1.0, float(all_dim) if all_dim else 0.0


def from_hf_config(arch: str, cfg: dict) -> ModelSpec:
    _check(arch, cfg)
    theta, yarn_factor, yarn_mscale, yarn_all_dim = _yarn(arch, cfg)
    nope, rope, v = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
    if rope % 2:
        raise _refuse(arch, "qk_rope_head_dim", rope, "RoPE rotates pairs of dimensions")
    q_lora = cfg.get("q_lora_rank")
    mla = MLA(int(q_lora) if q_lora else None, int(cfg["kv_lora_rank"]), nope, rope, v,
              hf_rope_interleaved=arch == "DeepseekV2ForCausalLM" or bool(cfg.get("rope_interleave", True)),
              yarn_factor=yarn_factor, yarn_mscale=yarn_mscale, yarn_mscale_all_dim=yarn_all_dim)
    heads = int(cfg["num_attention_heads"])
    layers = int(cfg["num_hidden_layers"])
    return ModelSpec(
        architecture=arch, num_layers=layers, hidden_size=int(cfg["hidden_size"]),
        ffn_hidden_size=int(cfg["intermediate_size"]), num_attention_heads=heads, num_query_groups=heads,
        kv_channels=nope + rope, vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)), rotary_base=theta, rope_scaling_factor=None,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=False, qk_norm=False,
        experts=_experts(arch, cfg, layers), attention_dropout=float(cfg.get("attention_dropout") or 0.0), mla=mla)


def _pairs(rows: torch.Tensor, d: int, to_megatron: bool) -> torch.Tensor:
    """The d RoPE rows (dim -2) from halves [x_0..x_{d/2-1}; x_{d/2}..] into pairs
    (x_0, x_{d/2}), (x_1, x_{d/2+1}), ... (to_megatron), or back."""
    shape = (2, d // 2) if to_megatron else (d // 2, 2)
    return rows.unflatten(-2, shape).transpose(-3, -2).flatten(-3, -2)


def _query(spec: ModelSpec, to_megatron: bool):
    """The query projection's rows, [nope; rope] per head, with the RoPE rows re-laid if needed."""
    m = spec.mla

    def convert(t: torch.Tensor) -> torch.Tensor:
        heads = t.reshape(spec.num_attention_heads, m.qk_head_dim + m.qk_pos_emb_head_dim, -1)
        nope, rope = heads.split([m.qk_head_dim, m.qk_pos_emb_head_dim], dim=1)
        return torch.cat([nope, _pairs(rope, m.qk_pos_emb_head_dim, to_megatron)], dim=1).reshape(t.shape)

    if m.hf_rope_interleaved:
        return names._same if to_megatron else names._back
    return (lambda ts: convert(ts[0])) if to_megatron else (lambda t: [convert(t)])


def _latent(spec: ModelSpec, to_megatron: bool):
    """kv_a_proj_with_mqa's rows, [kv_lora_rank; rope], with the RoPE rows re-laid if needed."""
    m = spec.mla

    def convert(t: torch.Tensor) -> torch.Tensor:
        latent, rope = t.split([m.kv_lora_rank, m.qk_pos_emb_head_dim], dim=0)
        return torch.cat([latent, _pairs(rope, m.qk_pos_emb_head_dim, to_megatron)], dim=0)

    if m.hf_rope_interleaved:
        return names._same if to_megatron else names._back
    return (lambda ts: convert(ts[0])) if to_megatron else (lambda t: [convert(t)])


def layer_groups(spec: ModelSpec, i: int) -> list[names.Group]:
    """Layer i's parameters: MLA, then a dense MLP (i < first_k_dense_replace) or the MoE block."""
    G, same, back = names.Group, names._same, names._back
    hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
    a, sa = hf + "self_attn.", mg + "self_attention."
    out = [G(mg + "input_layernorm.weight", (hf + "input_layernorm.weight",), same, back)]
    query = (_query(spec, True), _query(spec, False))
    if spec.mla.q_lora_rank is None:
        out.append(G(sa + "linear_q_proj.weight", (a + "q_proj.weight",), *query))
    else:
        out += [G(sa + "linear_q_down_proj.weight", (a + "q_a_proj.weight",), same, back),
                G(sa + "q_layernorm.weight", (a + "q_a_layernorm.weight",), same, back),
                G(sa + "linear_q_up_proj.weight", (a + "q_b_proj.weight",), *query)]
    out += [G(sa + "linear_kv_down_proj.weight", (a + "kv_a_proj_with_mqa.weight",),
              _latent(spec, True), _latent(spec, False)),
            G(sa + "kv_layernorm.weight", (a + "kv_a_layernorm.weight",), same, back),
            G(sa + "linear_kv_up_proj.weight", (a + "kv_b_proj.weight",), same, back),
            G(sa + "linear_proj.weight", (a + "o_proj.weight",), same, back),
            G(mg + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), same, back)]
    experts = spec.experts
    if i < experts.dense_layers:
        return out + names._mlp(spec, hf, mg)
    m, e = hf + "mlp.", mg + "mlp."
    out.append(G(e + "router.weight", (m + "gate.weight",), same, back))
    if experts.expert_bias:
        out.append(G(e + "router.expert_bias", (m + "gate.e_score_correction_bias",), same, back))
    for j in range(experts.num_experts):
        out += names._swiglu(f"{e}experts.local_experts.{j}.", f"{m}experts.{j}.gate_proj.weight",
                             f"{m}experts.{j}.up_proj.weight", f"{m}experts.{j}.down_proj.weight")
    return out + names._swiglu(e + "shared_experts.", m + "shared_experts.gate_proj.weight",
                               m + "shared_experts.up_proj.weight", m + "shared_experts.down_proj.weight")


def mtp_layer(spec: ModelSpec, tensor: str) -> UserError | None:
    """The one line for a tensor of DeepSeek-V3's multi-token-prediction layers (layers past
    num_hidden_layers), which transformers' forward never uses and this converter does not map."""
    if spec.mla is None or not tensor.startswith("model.layers."):
        return None
    index = tensor.split(".")[2]
    if not index.isdigit() or int(index) < spec.num_layers:
        return None
    return UserError(f"tensor {tensor} belongs to a multi-token-prediction layer (num_nextn_predict_layers; "
                     f"layers {spec.num_layers} on), which transformers' {spec.architecture} does not run and "
                     "npuspeed convert does not map: pass --drop-mtp-layers to convert without them")
