"""Every Megatron parameter of a converted model and the Hugging Face tensors that make it, in
order (embedding, layers, final norm, output): the table both directions walk. The pieces (how
q/k/v fuse, SwiGLU, experts) are npuspeed/convert/names.py's, DeepSeek's layers deepseek.py's;
this module only puts them together, so neither imports the other.
"""
from __future__ import annotations

from npuspeed.convert import deepseek
from npuspeed.convert.names import Group, _back, _mlp, _moe, _same, _whole, fuse_qkv, pad_rows, qkv_views, split_qkv
from npuspeed.convert.model_spec import ModelSpec


def layer(spec: ModelSpec, i: int) -> list[Group]:
    if spec.mla is not None:  # DeepSeek's multi-latent attention and MoE layout
        return deepseek.layer_groups(spec, i)
    hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
    attn = hf + "self_attn."
    qkv = tuple(f"{attn}{p}_proj.weight" for p in "qkv")
    groups = [
        Group(mg + "input_layernorm.weight", (hf + "input_layernorm.weight",), _same, _back, _whole),
        Group(mg + "self_attention.linear_qkv.weight", qkv,
              lambda t: fuse_qkv(*t, spec), lambda t: split_qkv(t, spec), lambda t: qkv_views(t, spec)),
        Group(mg + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), _same, _back, _whole),
        Group(mg + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), _same, _back, _whole),
    ]
    groups += _mlp(spec, hf, mg) if spec.experts is None else _moe(spec, hf, mg)
    if spec.qkv_bias:
        groups.insert(2, Group(mg + "self_attention.linear_qkv.bias", tuple(n[:-6] + "bias" for n in qkv),
                               lambda t: fuse_qkv(*t, spec), lambda t: split_qkv(t, spec),
                               lambda t: qkv_views(t, spec)))
    if spec.qk_norm:
        groups[3:3] = [Group(mg + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), _same, _back,
                             _whole),
                       Group(mg + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), _same, _back,
                             _whole)]
    return groups


def groups(spec: ModelSpec, padded_vocab: int) -> list[Group]:
    """Every Megatron parameter of the model in order: embedding, layers, final norm, output."""
    vocab = spec.vocab_size

    def pad(t):
        return pad_rows(t[0], padded_vocab)

    def unpad(t):
        return [t[:vocab]]  # leading rows: contiguous, and the only tensor on its storage

    out = [Group("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), pad, unpad, unpad)]
    for i in range(spec.num_layers):
        out += layer(spec, i)
    out.append(Group("decoder.final_layernorm.weight", ("model.norm.weight",), _same, _back, _whole))
    if not spec.tied_embeddings:
        out.append(Group("output_layer.weight", ("lm_head.weight",), pad, unpad, unpad))
    return out
