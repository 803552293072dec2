"""Which Hugging Face tensors make each global parameter of Megatron's local-spec GPTModel, and how.

Three parameters are not a rename:
- `linear_qkv` fuses q_proj, k_proj and v_proj per query group: for each of the ng groups,
  that group's query heads, then its key head, then its value head (rows of kv_channels);
  its bias (Qwen2) the same way.
- SwiGLU's `linear_fc1` is [gate_proj; up_proj].
- the embedding and the untied output layer have the vocabulary padded to a multiple of
  --make-vocab-size-divisible-by x TP (rows of zeros, cut off again on the way back).
Layer norms keep their own modules in the local spec (input_layernorm, pre_mlp_layernorm,
q_layernorm/k_layernorm), unlike Transformer Engine's spec, which folds them into the linears
(the local spec's sharded_state_dict stores them under TE's keys, linear_qkv.layer_norm_weight
and linear_fc1.layer_norm_weight, which is dist_checkpointing's business, not this mapping's).
MoE layers: the router, each expert's SwiGLU as SequentialMLP's local_experts.<global j>, and
Qwen2-MoE's shared expert with its gate. DeepSeek-V2/V3 layers: npuspeed/convert/deepseek.py; the
whole model's table: npuspeed/convert/name_table.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from npuspeed.convert.model_spec import ModelSpec


@dataclass(frozen=True)
class Group:
    """One Megatron parameter (global name, TP=1 shape) and the HF tensors it is made of.
    `views`: where each HF tensor lies in the parameter, as views of it whose row-major order
    is the HF tensor's (the rest, if any, is padding: zeros), so the converter reads and writes
    the HF tensors in place (hf_to_megatron.py, megatron_to_hf.py) without a fused copy."""

    megatron: str
    hf: tuple[str, ...]
    to_megatron: Callable[[list[torch.Tensor]], torch.Tensor]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]
    views: Callable[[torch.Tensor], list[torch.Tensor]] | None = None


def _same(tensors):
    return tensors[0]


def _back(tensor):
    return [tensor]


def _whole(tensor):
    return [tensor]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """[q; k; v] of HF -> Megatron's per-group [q_g; k_g; v_g] (weights or biases)."""
    d, ng = spec.kv_channels, spec.num_query_groups
    rest = q.shape[1:]
    q = q.reshape(ng, spec.heads_per_group * d, *rest)
    k = k.reshape(ng, d, *rest)
    v = v.reshape(ng, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    d, ng = spec.kv_channels, spec.num_query_groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, (spec.heads_per_group + 2) * d, *rest)
    q, k, v = grouped.split([spec.heads_per_group * d, d, d], dim=1)
    return [t.reshape(-1, *rest).clone() for t in (q, k, v)]


def qkv_views(qkv: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    """The q, k and v parts of a fused linear_qkv, as [groups, rows of the group, ...] views."""
    d, hq = spec.kv_channels, spec.heads_per_group * spec.kv_channels
    grouped = qkv.view(spec.num_query_groups, hq + 2 * d, *qkv.shape[1:])
    return [grouped[:, :hq], grouped[:, hq:hq + d], grouped[:, hq + d:]]


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    pad = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, pad], dim=0)


def _swiglu(mg: str, gate: str, up: str, down: str) -> list[Group]:
    """fc1 = [gate; up], fc2 = down, under Megatron prefix `mg` (an MLP or one expert)."""
    return [Group(mg + "linear_fc1.weight", (gate, up), lambda t: torch.cat(t, dim=0),
                  lambda t: [c.clone() for c in t.chunk(2, dim=0)], lambda t: list(t.chunk(2, dim=0))),
            Group(mg + "linear_fc2.weight", (down,), _same, _back, _whole)]


def _mlp(spec: ModelSpec, hf: str, mg: str) -> list[Group]:
    return _swiglu(mg + "mlp.", hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight", hf + "mlp.down_proj.weight")


#: architecture -> (HF prefix of the MoE block, names of an expert's gate, up and down projections)
_MOE_NAMES = {"MixtralForCausalLM": ("block_sparse_moe.", ("w1", "w3", "w2")),
              "Qwen2MoeForCausalLM": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
              "Qwen3MoeForCausalLM": ("mlp.", ("gate_proj", "up_proj", "down_proj"))}


def _moe(spec: ModelSpec, hf: str, mg: str) -> list[Group]:
    """The router, then each expert's SwiGLU (Megatron's SequentialMLP: local_experts.<global j>)."""
    block, (gate, up, down) = _MOE_NAMES[spec.architecture]
    out = [Group(mg + "mlp.router.weight", (hf + block + "gate.weight",), _same, _back, _whole)]
    for j in range(spec.experts.num_experts):
        e = f"{hf}{block}experts.{j}."
        out += _swiglu(f"{mg}mlp.experts.local_experts.{j}.", f"{e}{gate}.weight", f"{e}{up}.weight",
                       f"{e}{down}.weight")
    if spec.experts.shared_ffn_hidden_size:  # Qwen2-MoE's shared expert and its sigmoid gate
        e = f"{hf}{block}shared_expert."
        out += _swiglu(f"{mg}mlp.shared_experts.", f"{e}{gate}.weight", f"{e}{up}.weight", f"{e}{down}.weight")
        out.append(Group(f"{mg}mlp.shared_experts.gate_weight", (f"{hf}{block}shared_expert_gate.weight",),
                         _same, _back, _whole))
    return out


#: HF tensors that hold no weights (buffers some older checkpoints saved)
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
