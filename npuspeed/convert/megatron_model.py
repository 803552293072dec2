"""The local-spec GPTModel of a ModelSpec at the layout of Megatron's parallel state: the
whole (TP=1, one-stage) model in the converter, one rank's part in a TP/PP/EP job.

Both directions build it on the meta device: its sharded_state_dict says each tensor's stored
key, global shape and offsets, which the converter writes (lazy_save.py) or reads
(dcp_regions.py) one parameter at a time; dist_checkpointing stores each tensor with its
global shape, so the checkpoint loads at any TP/PP/VPP/EP layout. The tests build it with real
weights to compare logits, at TP1 and at TP2/PP2/EP2 (tests/distributed/test_convert_layouts.py).
Megatron's process groups are set up for one rank here when the
caller has none (a single-process gloo group).
"""
from __future__ import annotations

import contextlib
import inspect
import os
import tempfile

import torch

from npuspeed.convert.model_spec import ModelSpec
from npuspeed.errors import UserError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _supported(fn, kwargs: dict) -> dict:
    """The keyword arguments `fn` takes (megatron-core releases add and drop some)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def runtime_first() -> None:
    """npuspeed's device layer before megatron.core is imported (as the adaptor line does):
    Megatron's RNG tracker and collectives then work on any accelerator, the host included."""
    from npuspeed import runtime

    runtime.initialize([])


@contextlib.contextmanager
def single_rank():
    """torch.distributed and Megatron's model-parallel state for one rank (TP=PP=1), made here
    and torn down after unless the caller already had them."""
    runtime_first()
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    own_pg = not dist.is_initialized()
    store_dir = None
    if own_pg:
        store_dir = tempfile.mkdtemp(prefix="npuspeed-convert-")
        store = dist.FileStore(os.path.join(store_dir, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    own_mp = not mpu.model_parallel_is_initialized()
    if own_mp:
        mpu.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    elif mpu.get_tensor_model_parallel_world_size() * mpu.get_pipeline_model_parallel_world_size() != 1:
        raise UserError("npuspeed convert runs in one process: call it outside a TP/PP > 1 job")
    try:
        yield
    finally:
        if own_mp:
            mpu.destroy_model_parallel()
        if own_pg:
            dist.destroy_process_group()
            import shutil

            shutil.rmtree(store_dir, ignore_errors=True)


def _layout() -> dict:
    """The TP/PP/EP sizes of Megatron's parallel state, as TransformerConfig fields (a model whose
    config says other sizes than its process groups splits its tensors wrongly)."""
    from megatron.core import parallel_state as mpu

    return dict(tensor_model_parallel_size=mpu.get_tensor_model_parallel_world_size(),
                pipeline_model_parallel_size=mpu.get_pipeline_model_parallel_world_size(),
                expert_model_parallel_size=mpu.get_expert_model_parallel_world_size(),
                expert_tensor_parallel_size=mpu.get_expert_tensor_parallel_world_size())


def transformer_config(spec: ModelSpec, dtype: torch.dtype):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels, normalization="RMSNorm", layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=True, perform_initialization=False, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, **_layout(),
    )
    if spec.experts is not None:
        kwargs.update(num_moe_experts=spec.experts.num_experts, moe_ffn_hidden_size=spec.experts.ffn_hidden_size,
                      moe_router_topk=spec.experts.topk, moe_router_pre_softmax=spec.experts.pre_softmax,
                      moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
                      moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
                      moe_shared_expert_intermediate_size=spec.experts.shared_ffn_hidden_size,
                      moe_shared_expert_gate=spec.experts.shared_gate)
    if spec.mla is not None:
        return _mla_config(spec, kwargs)
    return TransformerConfig(**_supported(TransformerConfig, kwargs))


#: megatron-core releases whose local-spec MLA the DeepSeek conversion is tested on (logits and
#: round trip): (major, minor)
MLA_RELEASES = ((0, 12), (0, 13), (0, 14), (0, 15), (0, 16), (0, 19))


def _mla_config(spec: ModelSpec, kwargs: dict):
    """MLATransformerConfig of a DeepSeek model: plain RoPE on the rotary part (rope_type rope,
    so softmax scale 1/sqrt(qk_head_dim + qk_pos_emb_head_dim)), the q/kv latent norms as the
    local spec's qk_layernorm, and DeepSeek's routing and dense first layers."""
    import megatron.core
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    version = getattr(megatron.core, "__version__", "?")
    release = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    if release not in MLA_RELEASES:
        raise UserError(f"{spec.architecture}: multi-latent attention conversion is tested on megatron-core "
                        f"{', '.join('%d.%d' % r for r in MLA_RELEASES)}, not {version}; use one of those")
    m, e = spec.mla, spec.experts
    if m.q_lora_rank is None and release >= (0, 19):
        raise UserError(f"{spec.architecture}: q_lora_rank null (one query projection, as DeepSeek-V2-Lite): "
                        f"megatron-core {version}'s MLA then builds the query projection as a fused norm+linear, "
                        "which the local spec has not (Transformer Engine only); convert with megatron-core 0.16")
    kwargs.update(multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                  qk_head_dim=m.qk_head_dim, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
                  transformer_impl="local", rotary_base=spec.rotary_base, rotary_percent=1.0, qk_layernorm=True,
                  **_mla_rope(m, release),
                  moe_router_score_function=e.score_function, moe_router_enable_expert_bias=e.expert_bias,
                  moe_router_topk_scaling_factor=e.scaling_factor, moe_router_num_groups=e.num_groups,
                  moe_router_group_topk=e.group_topk,
                  moe_layer_freq=[0] * e.dense_layers + [1] * (spec.num_layers - e.dense_layers))
    return MLATransformerConfig(**_supported(MLATransformerConfig, kwargs))


def _mla_rope(m, release: tuple) -> dict:
    """Plain RoPE (rotary_scaling_factor 1: megatron-core 0.12/0.13 scale the softmax by YaRN's
    mscale of it even then), or YaRN with DeepSeek's settings."""
    if m.yarn_factor is None:
        return dict(rope_type="rope", rotary_scaling_factor=1.0)
    if release < (0, 15):  # 0.12/0.13 scale the softmax by mscale, not mscale_all_dim; 0.14 cannot build on meta
        raise UserError(f"YaRN RoPE scaling with multi-latent attention converts on megatron-core 0.15, 0.16 and "
                        f"0.19, not 0.{release[1]}; use one of those")
    from npuspeed.convert.deepseek import YARN_FIXED

    return dict(rope_type="yarn", rotary_scaling_factor=m.yarn_factor, mscale=m.yarn_mscale,
                mscale_all_dim=m.yarn_mscale_all_dim, **YARN_FIXED)


def build(spec: ModelSpec, padded_vocab: int, dtype: torch.dtype):
    """This rank's GPTModel at the layout of Megatron's parallel state (the whole model inside
    `single_rank()`; a pipeline stage holds its layers only); parameters uninitialised."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(spec, dtype)
    if spec.mla is not None:  # per-layer specs: MLA everywhere, dense MLPs in the first layers
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        from npuspeed.convert.mla_core_attention import local_mla_spec

        layer_spec = local_mla_spec(get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                               normalization="RMSNorm"))
    else:
        layer_spec = get_gpt_layer_local_spec(**_supported(get_gpt_layer_local_spec, dict(
            qk_layernorm=spec.qk_norm, normalization="RMSNorm",
            num_experts=spec.experts.num_experts if spec.experts else None, moe_grouped_gemm=False)))
    kwargs = dict(config=config, transformer_layer_spec=layer_spec,
                  vocab_size=padded_vocab, max_sequence_length=spec.max_position_embeddings,
                  pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage(),
                  parallel_output=True,
                  share_embeddings_and_output_weights=spec.tied_embeddings, position_embedding_type="rope",
                  rotary_percent=1.0, rotary_base=spec.rotary_base,
                  rope_scaling=spec.rope_scaling_factor is not None,
                  rope_scaling_factor=spec.rope_scaling_factor or 8.0)
    if spec.rope_scaling_factor is not None and "rope_scaling_factor" not in inspect.signature(GPTModel).parameters:
        import megatron.core

        raise UserError(f"megatron-core {getattr(megatron.core, '__version__', '?')}'s GPTModel has no "
                        "rope_scaling_factor: Llama 3's RoPE scaling needs megatron-core 0.13 or later")
    # every parameter in the run's precision, norms included (torch's norms ignore params_dtype;
    # Megatron's Float16Module casts them the same way in a bf16/fp16 run)
    from npuspeed.convert.mla_core_attention import buildable

    with buildable() if spec.mla is not None else contextlib.nullcontext():
        model = GPTModel(**_supported(GPTModel.__init__, kwargs)).to(dtype)
    for name, buf in model.named_buffers():  # Megatron keeps (and saves) the router's expert bias in fp32
        if name.endswith("router.expert_bias"):
            buf.data = buf.data.float()
    return model


def check_names(model, expected: list[str]) -> dict:
    """The model's parameters by name, which must be exactly the converter's `expected` names:
    a megatron-core release whose local spec names them otherwise fails here, not with a
    half-converted checkpoint."""
    import megatron.core

    params = dict(model.named_parameters())
    params.update((n, b) for n, b in model.named_buffers() if n.endswith("router.expert_bias"))
    extra = sorted(set(params) - set(expected))
    missing = sorted(set(expected) - set(params))
    if extra or missing:
        what = f"has {extra[0]}, which the converter does not fill" if extra else f"lacks {missing[0]}"
        raise UserError(f"megatron-core {getattr(megatron.core, '__version__', '?')}'s local-spec GPTModel {what}: "
                        "this release's parameter names are not mapped by npuspeed convert")
    return params
