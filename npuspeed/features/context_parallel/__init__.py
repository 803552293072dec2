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

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import Feature
from npuspeed.features.context_parallel import patches, validate
from npuspeed.features.context_parallel.attention import ATTR
from npuspeed.features.context_parallel.layout import ALGOS, CPLayout
from npuspeed.ops import flash_attention as cpu_flash

#: DotProductAttention.__init__, get_pos_emb_on_this_cp_rank unchanged 0.12-0.19;
#: initialize_model_parallel keeps hierarchical_context_parallel_sizes (0.19 adds GTP sizes)
MEGATRON_RANGE = ">=0.12,<0.20"


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
        validate.check(ctx, self.layout(ctx.args))

    def prepare(self, ctx) -> None:
        if not for_device(ctx.accelerator.name).host_is_device():
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

    def plan_effect(self, model, ctx):
        """Per rank S/CP tokens (the planner splits the sequence); the core attention is the
        CP algorithm's, its Ulysses and ring degrees as options: the planner (plan/ops_cp.py)
        prices what it saves, holds in flight and sends (a feature never imports the planner)."""
        from npuspeed.features.base import PlanEffect

        size = model.layout.cp
        if size < 2:
            return None
        cp = CPLayout.make(ctx.args.context_parallel_algo or "megatron_cp_algo", size, ctx.args.ulysses_degree_in_cp)
        what = {"ring": f"K/V blocks around a ring of {cp.ring}",
                "ulysses": f"all-to-all over {cp.ulysses} ranks (heads for tokens)",
                "hybrid": f"Ulysses all-to-all in groups of {cp.ulysses}, ring of {cp.ring} across them"}[cp.short]
        return PlanEffect(
            variants={"core_attention": "cp"}, kernels={"attention": "flash"},
            options={"cp_ulysses": cp.ulysses, "cp_ring": cp.ring},
            summary=f"activations of S/{size} tokens per rank; {cp.algo}: {what}; no S x S tensors")

    def path(self, ctx) -> str:
        cp = self.layout(ctx.args)
        what = {"ring": "ring attention: K/V blocks around the CP group (isend/irecv overlapped with each "
                        "block), partial outputs merged by log-sum-exp, dK/dV back around the ring",
                "ulysses": "Ulysses: all-to-all sequence -> heads before attention and back after",
                "hybrid": f"hybrid: Ulysses all-to-all in groups of {cp.ulysses}, ring across {cp.ring} groups"}
        traits = for_device(ctx.accelerator.name)
        kernel = ("npu_fusion_attention blocks" if traits.has_vendor_kernels() else
                  "PyTorch flash/efficient blocks" if traits.has_sdpa_kernels() else
                  "npuspeed::flash_attention(_fp32) blocks (PyTorch's CPU flash kernel where they cannot run)")
        size = ctx.args.context_parallel_size or "from the model config"
        return (f"{cp.algo} ({what[cp.short]}), CP {size}, Megatron's "
                f"load-balanced chunks; {kernel}; packed documents by PackedSeqParams")


__all__ = ["ContextParallelFeature"]
