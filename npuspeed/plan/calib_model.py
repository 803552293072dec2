"""The run's model, built with Megatron-Core's local modules for the calibration worker.

The calibration times Megatron's own TransformerLayer (and the embedding and loss around
it), not bare ops: a small model's step is mostly the framework's Python per module, and a
tensor-parallel layer's collectives wait for the other rank inside the step. So the worker
builds the same GPTModel a training run of `spec` builds (same config knobs as
examples/gpt_example/model.py), with only as many layers as it times.
"""
from __future__ import annotations

import inspect

import torch

from npuspeed.plan.spec import RunSpec


def _supported(fn, kwargs: dict) -> dict:
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def dtype_of(spec: RunSpec):
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.batch.dtype, torch.float32)


def config(spec: RunSpec, layers: int, extra: dict):
    """TransformerConfig of `spec` with `layers` layers; `extra`: tp, sp, cp, ep (this group)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    m = spec.model
    dtype = dtype_of(spec)
    kwargs = dict(
        num_layers=layers, hidden_size=m.hidden, ffn_hidden_size=m.ffn, num_attention_heads=m.heads,
        num_query_groups=m.query_groups if m.query_groups != m.heads else None, kv_channels=m.kv_channels,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout, normalization=m.normalization,
        gated_linear_unit=m.swiglu, activation_func=F.silu if m.swiglu else F.gelu, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, add_bias_linear=m.bias,
        tensor_model_parallel_size=extra["tp"], pipeline_model_parallel_size=1, sequence_parallel=extra["sp"],
        context_parallel_size=extra.get("cp", 1), expert_model_parallel_size=extra.get("ep", 1),
        num_moe_experts=m.num_experts, moe_router_topk=m.moe_topk,
        moe_ffn_hidden_size=m.moe_ffn if m.num_experts else None, moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=bool(m.num_experts and extra.get("grouped_gemm")),
        expert_tensor_parallel_size=extra.get("etp") or extra["tp"],
        recompute_granularity=m.recompute_granularity, recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers if m.recompute_granularity == "full" else None,
        use_cpu_initialization=True, perform_initialization=True, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=spec.batch.dtype == "bf16", fp16=spec.batch.dtype == "fp16", deallocate_pipeline_outputs=True,
    )
    if m.recompute_granularity == "full" and not m.recompute_method:
        kwargs["recompute_method"] = "uniform"
        kwargs["recompute_num_layers"] = 1
    return TransformerConfig(**_supported(TransformerConfig, kwargs))


def build(spec: RunSpec, layers: int, extra: dict, pre: bool, post: bool):
    """A GPTModel chunk of `layers` layers (Float16Module-wrapped for bf16/fp16, as training runs it)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    m = spec.model
    cfg = config(spec, layers, extra)
    layer_spec = get_gpt_layer_local_spec(**_supported(get_gpt_layer_local_spec, dict(
        num_experts=m.num_experts, moe_grouped_gemm=bool(m.num_experts and extra.get("grouped_gemm")),
        qk_layernorm=False, normalization=m.normalization)))
    vocab = m.padded_vocab(extra["tp"])
    model = GPTModel(**_supported(GPTModel.__init__, dict(
        config=cfg, transformer_layer_spec=layer_spec, vocab_size=vocab,
        max_sequence_length=m.max_position_embeddings or m.seq_length, pre_process=pre, post_process=post,
        parallel_output=True, share_embeddings_and_output_weights=m.tied_embeddings,
        position_embedding_type=m.position_embedding)))
    if spec.batch.dtype != "fp32":
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, model)
    return model, cfg


def unwrap(model):
    return getattr(model, "module", model)
