"""Tiny Hugging Face models made locally with `transformers` (random weights, nothing
downloaded), and the logits of the Megatron model a converted checkpoint holds: shared by the
convert tests (tests/unit/test_convert.py, tests/distributed/test_convert_example.py)."""
from __future__ import annotations

import glob
import json
import os

import torch
import transformers
from safetensors import torch as safetensors_torch

VOCAB = 258  # the example's byte-level tokenizer


def hf_config(arch: str, **overrides):
    cls = getattr(transformers, {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                                 "qwen3": "Qwen3Config", "mixtral": "MixtralConfig",
                                 "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig",
                                 "deepseek_v2": "DeepseekV2Config", "deepseek_v3": "DeepseekV3Config"}[arch])
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                  tie_word_embeddings=False, rms_norm_eps=1e-6)
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch == "mixtral":
        kwargs.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
    if arch == "qwen2_moe":
        kwargs.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False)
    if arch == "qwen3_moe":
        kwargs.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    if arch.startswith("deepseek"):  # MLA: 4 heads of 16+8 query/key and 12 value dims; 1 dense layer, 1 MoE
        kwargs.update(num_key_value_heads=4, head_dim=None, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, n_shared_experts=1,
                      num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=2,
                      topk_group=1, routed_scaling_factor=2.5)
        if arch == "deepseek_v2":  # group-limited: 3 of 8 experts from the best 2 of 4 groups (by their best)
            kwargs.update(topk_method="group_limited_greedy", norm_topk_prob=False, n_routed_experts=8,
                          num_experts_per_tok=3, n_group=4, topk_group=2, moe_intermediate_size=16)
        if arch == "deepseek_v3":
            kwargs.update(num_nextn_predict_layers=0)
    kwargs.update(overrides)
    if kwargs.get("head_dim", 0) is None:
        del kwargs["head_dim"]
    cfg = cls(**kwargs)
    cfg.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    return cfg


def make_hf(path, arch: str, seed: int = 0, shard="40KB", **overrides):
    """A random tiny model saved as safetensors shards; norms away from 1 so a swap shows."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(arch, **overrides)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():  # DeepSeek-V3's routing bias: large enough to change choices
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    model.save_pretrained(str(path), max_shard_size=shard)
    return model


def hf_tensors(path) -> dict:
    out = {}
    for file in glob.glob(os.path.join(str(path), "*.safetensors")):
        out.update(safetensors_torch.load_file(file))
    return out


def megatron_logits_at(path, config, tokens):
    """Logits of the whole local-spec model of HF `config` (a dict or a config.json path) loaded
    from dist_checkpointing directory `path` (written at any layout)."""
    from megatron.core import dist_checkpointing

    from npuspeed.convert import architectures, megatron_model

    if not isinstance(config, dict):
        with open(config) as f:
            config = json.load(f)
    spec = architectures.from_hf_config(config)
    meta = dist_checkpointing.load_tensors_metadata(path)
    padded = meta["embedding.word_embeddings.weight"].global_shape[0]
    model = megatron_model.build(spec, padded, torch.float32)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    model.load_state_dict(state["model"])
    model.eval()
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None)
