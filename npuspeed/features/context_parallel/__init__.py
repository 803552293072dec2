"""Context parallelism without Transformer Engine (`--context-parallel-size N`), and packed documents.

Megatron-Core's own CP runs only inside TE's attention. Here Megatron-Core's local
`DotProductAttention` (on fused attention's path, `--use-flash-attn`) runs MindSpeed's three
algorithms, `--context-parallel-algo`: `megatron_cp_algo` (ring, the default),
`ulysses_cp_algo` (all-to-all) and `hybrid_cp_algo` (Ulysses inside groups of
`--ulysses-degree-in-cp` ranks, ring across them), on one block-attention interface (blocks.py)
over npuspeed's CPU kernels, PyTorch's, or npu_fusion_attention. Megatron's data split
(`get_batch_on_this_cp_rank`), RoPE per CP rank, loss and gradient reduction over DP x CP
and the distributed optimizer are Megatron's own. Packed documents (PackedSeqParams, built
by the example from EoD with --reset-attention-mask) run on the same path, with or without CP.
"""
from __future__ import annotations

import argparse

from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.context_parallel import patches
from npuspeed.features.context_parallel.attention import ATTR
from npuspeed.features.context_parallel.layout import ALGOS, CPLayout
from npuspeed.ops import flash_attention as cpu_flash

MEGATRON_RANGE = ">=0.12,<0.17"
TE_COMM = {"p2p": "megatron_cp_algo", "a2a": "ulysses_cp_algo", "a2a+p2p": "hybrid_cp_algo"}


class ContextParallelFeature(Feature):
    name = "context_parallel"
    flags = ("--context-parallel-size", "--context-parallel-algo", "--ulysses-degree-in-cp")

    def add_arguments(self, group) -> None:
        group.add_argument("--context-parallel-size", type=int, default=None,
                           help="Megatron's CP size; with --transformer-impl local and --use-flash-attn npuspeed "
                                "runs it (no Transformer Engine needed).")
        group.add_argument("--context-parallel-algo", choices=ALGOS, default=None,
                           help="CP algorithm (MindSpeed's names): megatron_cp_algo = ring attention (default), "
                                "ulysses_cp_algo = all-to-all over heads, hybrid_cp_algo = Ulysses inside groups "
                                "of --ulysses-degree-in-cp ranks, ring across them.")
        group.add_argument("--ulysses-degree-in-cp", type=int, default=None,
                           help="With --context-parallel-algo hybrid_cp_algo: ranks per Ulysses group "
                                "(divides --context-parallel-size).")

    def enabled(self, args: argparse.Namespace) -> bool:
        return (getattr(args, "context_parallel_size", None) or 1) > 1 or any(
            getattr(args, a, None) is not None for a in ("context_parallel_algo", "ulysses_degree_in_cp"))

    @staticmethod
    def layout(args) -> CPLayout:
        return CPLayout.make(args.context_parallel_algo or "megatron_cp_algo", args.context_parallel_size or 1,
                             args.ulysses_degree_in_cp)

    def validate(self, ctx) -> None:
        args, meg = ctx.args, ctx.megatron
        size, algo, degree = args.context_parallel_size, args.context_parallel_algo, args.ulysses_degree_in_cp
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
        self._te_only(ctx)
        if size is None:
            return  # CP set in code: the model-build check compares (check_built)
        cp = self.layout(args)
        seq = meg.seq_length
        if seq is not None and seq % (2 * size):
            raise FeatureError(f"--seq-length {seq} does not divide by 2 x --context-parallel-size = {2 * size}: "
                               "Megatron's load-balanced split gives each CP rank two equal chunks; pad the "
                               f"sequence to a multiple of {2 * size}")
        heads = meg.num_attention_heads
        if heads is not None:
            patches.check_heads(cp, heads, meg.num_query_groups or heads, meg.tensor_model_parallel_size or 1)
        if getattr(args, "pre_tockens", None) is not None or getattr(args, "next_tockens", None) is not None:
            raise FeatureError("--pre-tockens/--next-tockens (band attention) are not supported with "
                               "--context-parallel-size > 1; drop them or CP")
        if (meg.attention_dropout or 0.0) > 0 and ctx.accelerator.name != "cpu":
            raise FeatureError(f"--attention-dropout {meg.attention_dropout} under --context-parallel-size on "
                               f"{ctx.accelerator.name}: its kernels do not draw dropout at global positions, so "
                               "CP would change the masks; set --attention-dropout 0")

    def _te_only(self, ctx) -> None:
        """What Megatron-Core's own CP (Transformer Engine's attention) would need: refused by name."""
        args, meg = ctx.args, ctx.megatron
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
        if meg.hierarchical_context_parallel_sizes and args.context_parallel_algo != "hybrid_cp_algo":
            raise FeatureError("--hierarchical-context-parallel-sizes is Transformer Engine's a2a+p2p CP: use "
                               "--context-parallel-algo hybrid_cp_algo --ulysses-degree-in-cp K")
        if not getattr(args, "use_flash_attn", False):
            raise FeatureError("--context-parallel-size with Megatron-Core's local attention needs --use-flash-attn: "
                               "Megatron-Core's own CP exists only in Transformer Engine's attention, npuspeed's "
                               "runs on the fused attention path")

    def prepare(self, ctx) -> None:
        if ctx.accelerator.name != "cpu":
            return
        if ctx.megatron.bf16 and cpu_flash.machine_reason():
            ctx.note("context parallelism: bf16 blocks run PyTorch's CPU flash kernel, not npuspeed's: "
                     f"{cpu_flash.machine_reason()}")
        if not ctx.megatron.bf16 and cpu_flash.fp32_reason():
            ctx.note("context parallelism: fp32 blocks run PyTorch's CPU flash kernel, not npuspeed's: "
                     f"{cpu_flash.fp32_reason()}")

    def register_patches(self, registry, ctx) -> None:
        algo, degree = ctx.args.context_parallel_algo or "megatron_cp_algo", ctx.args.ulysses_degree_in_cp
        registry.register(patches.ATTENTION, wrapper=patches.attention_init(algo, degree), feature=self.name,
                          megatron=MEGATRON_RANGE)
        registry.register(patches.ROPE, patches.get_pos_emb_on_this_cp_rank, feature=self.name,
                          megatron=MEGATRON_RANGE)
        registry.register(patches.INIT_MP, wrapper=patches.initialize_model_parallel(algo, degree),
                          feature=self.name, megatron=MEGATRON_RANGE)

    def check_built(self, block, ctx) -> str | None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        size = int(block.config.context_parallel_size or 1)
        given = ctx.args.context_parallel_size
        if given is not None and size != given:
            return (f"--context-parallel-size {given}, but the model was built with context_parallel_size {size}: "
                    "pass the same size to TransformerConfig")
        if size == 1:
            return ("--context-parallel-algo / --ulysses-degree-in-cp given, but the model has no context "
                    "parallelism (context_parallel_size 1): drop them or set a CP size")
        if not any(isinstance(m, DotProductAttention) and getattr(m, ATTR, None) for m in block.modules()):
            return ("--context-parallel-size: this block has no Megatron-Core local DotProductAttention for "
                    "npuspeed's CP (a Transformer Engine spec has TE's own CP): use --transformer-impl local")
        return None

    def path(self, ctx) -> str:
        cp = self.layout(ctx.args)
        what = {"ring": "ring attention: K/V blocks around the CP group (isend/irecv overlapped with each "
                        "block), partial outputs merged by log-sum-exp, dK/dV back around the ring",
                "ulysses": "Ulysses: all-to-all sequence -> heads before attention and back after",
                "hybrid": f"hybrid: Ulysses all-to-all in groups of {cp.ulysses}, ring across {cp.ring} groups"}
        kernel = ("npu_fusion_attention blocks" if ctx.accelerator.name == "npu" else
                  "PyTorch flash/efficient blocks" if ctx.accelerator.name == "cuda" else
                  "npuspeed::flash_attention(_fp32) blocks (PyTorch's CPU flash kernel where they cannot run)")
        size = ctx.args.context_parallel_size or "from the model config"
        return (f"{cp.algo} ({what[cp.short]}), CP {size}, Megatron's "
                f"load-balanced chunks; {kernel}; packed documents by PackedSeqParams")


__all__ = ["ContextParallelFeature"]
