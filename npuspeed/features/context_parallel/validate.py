"""The CP feature's start-up checks: each bad input named with its flag and the fix.

What Megatron-Core's own CP would need Transformer Engine for (TE's --cp-comm-type kinds,
--hierarchical-context-parallel-sizes, a TE layer spec, CP on the local attention without the
fused path), a sequence that does not split into 2 x CP chunks, heads or query groups the
Ulysses degree does not divide, and a hybrid degree that does not divide the CP size.
"""
from __future__ import annotations

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import FeatureError
from npuspeed.features.context_parallel import patches
from npuspeed.features.attention.layout import CPLayout

TE_COMM = {"p2p": "megatron_cp_algo", "a2a": "ulysses_cp_algo", "a2a+p2p": "hybrid_cp_algo"}


def check(ctx, config, cp: CPLayout) -> None:
    """Every start-up error of the CP feature (flags only; the model build checks the rest)."""
    meg = ctx.megatron
    size, algo, degree = config.context_parallel_size, config.context_parallel_algo, config.ulysses_degree_in_cp
    if size is not None and size < 1:
        raise FeatureError(f"--context-parallel-size {size}: must be >= 1")
    if size == 1:
        raise FeatureError("--context-parallel-algo / --ulysses-degree-in-cp do nothing with "
                           "--context-parallel-size 1: give a size > 1 or drop them")
    if degree is not None and algo != "hybrid_cp_algo":
        raise FeatureError(f"--ulysses-degree-in-cp only applies to --context-parallel-algo hybrid_cp_algo "
                           f"(got {algo or 'the default megatron_cp_algo'}): drop it or choose hybrid_cp_algo")
    if algo == "hybrid_cp_algo":
        if degree is None or degree < 1:
            raise FeatureError("--context-parallel-algo hybrid_cp_algo needs --ulysses-degree-in-cp K "
                               "(ranks per Ulysses group, dividing --context-parallel-size)")
        if size is not None and size % degree:
            raise FeatureError(f"--ulysses-degree-in-cp {degree} does not divide --context-parallel-size "
                               f"{size}: choose a divisor of it")
    _te_only(ctx, config)
    if size is None:
        return  # CP set in code: the model-build check compares (check_built)
    seq = meg.seq_length
    if seq is not None and seq % (2 * size):
        raise FeatureError(f"--seq-length {seq} does not divide by 2 x --context-parallel-size = {2 * size}: "
                           "Megatron's load-balanced split gives each CP rank two equal chunks; pad the "
                           f"sequence to a multiple of {2 * size}")
    heads = meg.num_attention_heads
    if heads is not None:
        patches.check_heads(cp, heads, meg.num_query_groups or heads, meg.tensor_model_parallel_size or 1)
    if config.pre_tockens is not None or config.next_tockens is not None:
        raise FeatureError("--pre-tockens/--next-tockens (band attention) are not supported with "
                           "--context-parallel-size > 1; drop them or CP")
    if (meg.attention_dropout or 0.0) > 0 and not for_device(ctx.accelerator.name).host_is_device():
        raise FeatureError(f"--attention-dropout {meg.attention_dropout} under --context-parallel-size on "
                           f"{ctx.accelerator.name}: its kernels do not draw dropout at global positions, so "
                           "CP would change the masks; set --attention-dropout 0")


def _te_only(ctx, config) -> None:
    """What Megatron-Core's own CP (Transformer Engine's attention) would need: refused by name."""
    meg = ctx.megatron
    impl = meg.transformer_impl
    if impl is not None and impl != "local":
        raise FeatureError(f"--transformer-impl {impl}: npuspeed's context parallelism runs Megatron-Core's local "
                           "attention; with Transformer Engine use its own CP (drop npuspeed's CP flags) or "
                           "pass --transformer-impl local")
    if meg.cp_comm_type:
        kinds = ", ".join(meg.cp_comm_type)
        known = [TE_COMM.get(k) for k in meg.cp_comm_type]
        fix = (f"use --context-parallel-algo {known[0]}" if len(set(known)) == 1 and known[0]
               else "npuspeed has no all_gather CP; use --context-parallel-algo megatron_cp_algo (ring)")
        raise FeatureError(f"--cp-comm-type {kinds} selects Transformer Engine's CP kernels, which Megatron-"
                           f"Core's local attention does not have: {fix} instead")
    if meg.hierarchical_context_parallel_sizes and config.context_parallel_algo != "hybrid_cp_algo":
        raise FeatureError("--hierarchical-context-parallel-sizes is Transformer Engine's a2a+p2p CP: use "
                           "--context-parallel-algo hybrid_cp_algo --ulysses-degree-in-cp K")
    if not config.use_flash_attn:
        raise FeatureError("--context-parallel-size with Megatron-Core's local attention needs --use-flash-attn: "
                           "Megatron-Core's own CP exists only in Transformer Engine's attention, npuspeed's "
                           "runs on the fused attention path")
