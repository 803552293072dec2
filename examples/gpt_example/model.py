"""The GPT model on megatron.core's local modules, and a layout-independent initialisation.

`--use-cpu-initialization` here means more than Megatron's: every weight is drawn from a
generator seeded by the seed and the weight's *global* name (global layer number, global
expert number), in the TP=1 layout, and then this rank's shard is cut out. So TP, PP,
VPP, EP and DP layouts of the same seed start from identical weights, which is what the
parity tests compare (Megatron's own CPU initialisation differs across PP stages and
shards SwiGLU's fused fc1 differently from its TP=1 layout).
"""
from __future__ import annotations

import contextlib
import inspect
import zlib

import torch
from megatron.core import parallel_state as mpu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from npuspeed.convert import layout
from npuspeed.convert.mla_core_attention import buildable


def padded_vocab_size(vocab: int, args) -> int:
    return layout.padded_vocab_size(vocab, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)


def _supported(fn, kwargs: dict) -> dict:
    """Keep only the keyword arguments `fn` accepts (megatron-core 0.12-0.16 differ)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def transformer_config(args) -> TransformerConfig:
    import torch.nn.functional as F

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    kwargs = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=bool(getattr(args, "gradient_accumulation_fusion", False)),
        add_bias_linear=not args.disable_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=_vpp_size(args),
        sequence_parallel=args.sequence_parallel,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size or (args.ffn_hidden_size if args.num_experts else None),
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=args.moe_token_drop_policy,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_overlap=args.moe_shared_expert_overlap,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_grouped_gemm=_grouped_gemm(args),
        expert_tensor_parallel_size=_expert_tp(args),
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        deallocate_pipeline_outputs=True,
        overlap_p2p_comm=args.overlap_p2p_comm,
        batch_p2p_comm=not args.overlap_p2p_comm,
        deterministic_mode=args.deterministic_mode,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_num_groups=args.moe_router_num_groups,
        moe_router_group_topk=args.moe_router_group_topk,
        moe_layer_freq=args.moe_layer_freq,
    )
    if args.multi_latent_attention:
        return _mla_config(args, kwargs)
    return TransformerConfig(**_supported(TransformerConfig, kwargs))


def _mla_config(args, kwargs: dict):
    """Megatron's MLATransformerConfig (DeepSeek-V2/V3) as Megatron-LM makes it from these flags
    (rope type yarn unless given; --rotary-scaling-factor 1 by default, which also keeps
    megatron-core 0.12/0.13's softmax scale 1/sqrt(head size) with plain RoPE)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    kwargs.update(multi_latent_attention=True, q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
                  qk_head_dim=args.qk_head_dim, qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
                  v_head_dim=args.v_head_dim, rope_type=args.rope_type or "yarn", rotary_base=args.rotary_base,
                  rotary_percent=args.rotary_percent, rotary_scaling_factor=args.rotary_scaling_factor,
                  mscale=args.mscale, mscale_all_dim=args.mscale_all_dim, transformer_impl="local")
    return MLATransformerConfig(**_supported(MLATransformerConfig, kwargs))


def _block_spec(args, config, stage):
    """Per-layer specs where layers differ (dense first layers, MLA); None: one layer spec fits."""
    if not args.multi_latent_attention and args.moe_layer_freq == 1:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from npuspeed.convert.mla_core_attention import local_mla_spec

    spec = get_gpt_decoder_block_spec(**_supported(get_gpt_decoder_block_spec, dict(
        config=config, use_transformer_engine=False, normalization=args.normalization, vp_stage=stage)))
    return local_mla_spec(spec) if args.multi_latent_attention else spec


def _grouped_gemm(args) -> bool:
    """--moe-grouped-gemm (Megatron's flag; npuspeed's group defines it when Megatron's parser does not)."""
    return bool(args.num_experts and getattr(args, "moe_grouped_gemm", False))


def _expert_tp(args):
    """Expert weights are split over this many ranks (Megatron's default: the TP size)."""
    return args.expert_tensor_parallel_size or args.tensor_model_parallel_size


def _vpp_size(args):
    if args.num_layers_per_virtual_pipeline_stage is None:
        return None
    per_stage = args.num_layers // args.pipeline_model_parallel_size
    return per_stage // args.num_layers_per_virtual_pipeline_stage


def build_model(args, config: TransformerConfig, vocab_size: int) -> list[torch.nn.Module]:
    """One GPTModel per virtual pipeline stage (a list of one without VPP)."""
    spec_kwargs = dict(num_experts=args.num_experts, moe_grouped_gemm=_grouped_gemm(args), qk_layernorm=args.qk_layernorm,
                       normalization=args.normalization)
    spec = get_gpt_layer_local_spec(**_supported(get_gpt_layer_local_spec, spec_kwargs))
    vpp = _vpp_size(args)
    chunks = []
    for stage in range(vpp or 1):
        if vpp:
            mpu.set_virtual_pipeline_model_parallel_rank(stage)
        pre = mpu.is_pipeline_first_stage(**_supported(mpu.is_pipeline_first_stage, dict(
            ignore_virtual=False, vp_stage=stage if vpp else None)))
        post = mpu.is_pipeline_last_stage(**_supported(mpu.is_pipeline_last_stage, dict(
            ignore_virtual=False, vp_stage=stage if vpp else None)))
        kwargs = dict(
            config=config, transformer_layer_spec=_block_spec(args, config, stage if vpp else None) or spec,
            vocab_size=vocab_size,
            max_sequence_length=args.max_position_embeddings, pre_process=pre, post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
            rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
            vp_stage=stage if vpp else None,
        )
        with buildable() if args.multi_latent_attention else contextlib.nullcontext():
            chunks.append(GPTModel(**_supported(GPTModel.__init__, kwargs)))
    if vpp:
        mpu.set_virtual_pipeline_model_parallel_rank(0)
    return chunks


# -- layout-independent initialisation ---------------------------------------------------------
# global names and shards: npuspeed.convert.layout (the checkpoint converter uses the same rules)
_OUTPUT_LAYERS = ("linear_proj.weight", "linear_fc2.weight")
_shard = layout.shard
_full_shape = layout.full_shape


@torch.no_grad()
def initialize_by_global_name(chunks, args, config) -> None:
    tp_size, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    ep_size = mpu.get_expert_model_parallel_world_size()
    ep_rank = mpu.get_expert_model_parallel_rank()
    etp_size = mpu.get_expert_tensor_parallel_world_size()
    etp_rank = mpu.get_expert_tensor_parallel_rank()
    num_local_experts = (args.num_experts or 0) // max(ep_size, 1)
    scaled_std = args.init_method_std / (2.0 * args.num_layers) ** 0.5
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if param.dim() < 2:
                continue  # biases (zero) and norms (one) are layout-independent already
            if name.endswith(_GROUPED):
                _init_grouped(param, layout.global_name(name, chunk, num_local_experts, ep_rank), args,
                              num_local_experts, ep_rank, etp_size, etp_rank, scaled_std)
                continue
            gname = layout.global_name(name, chunk, num_local_experts, ep_rank)
            expert = getattr(param, "allreduce", True) is False  # experts shard over expert-TP
            t_size, t_rank = (etp_size, etp_rank) if expert else (tp_size, tp_rank)
            gen = torch.Generator().manual_seed(args.seed * 1_000_003 + zlib.crc32(gname.encode()))
            std = scaled_std if gname.endswith(_OUTPUT_LAYERS) else args.init_method_std
            full = torch.empty(_full_shape(param, t_size), dtype=torch.float32)
            full.normal_(0.0, std, generator=gen)
            shard = _shard(full, param, gname, args.swiglu, t_rank, t_size)
            param.data.copy_(shard.to(param.dtype))


_GROUPED = (".experts.weight1", ".experts.weight2")


def _init_grouped(param, name: str, args, num_local: int, ep_rank: int, etp_size: int, etp_rank: int,
                  scaled_std: float) -> None:
    """Megatron's GroupedMLP holds local expert l's fc1 as weight1.view(E, H, -1)[l] (the
    transpose of SequentialMLP's linear_fc1.weight) and its fc2 as weight2.view(E, -1, H)[l]:
    fill each from the generator of the SequentialMLP weight of the same global expert."""
    hidden = args.hidden_size
    fc1 = name.endswith(".weight1")
    view = param.data.view(num_local, hidden, -1) if fc1 else param.data.view(num_local, -1, hidden)
    ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    for local in range(num_local):
        expert = ep_rank * num_local + local
        gname = name.replace(".experts.weight1" if fc1 else ".experts.weight2",
                             f".experts.local_experts.{expert}.linear_fc{1 if fc1 else 2}.weight")
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + zlib.crc32(gname.encode()))
        shape = [ffn * (2 if args.swiglu else 1), hidden] if fc1 else [hidden, ffn]
        full = torch.empty(shape, dtype=torch.float32).normal_(0.0, args.init_method_std if fc1 else scaled_std,
                                                              generator=gen)
        shard = layout.shard_dim(full, 0 if fc1 else 1, fc1 and args.swiglu, etp_rank, etp_size)
        view[local].copy_(shard.t().to(param.dtype))
