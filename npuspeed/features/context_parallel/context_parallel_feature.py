"""Context parallelism without Transformer Engine (`--context-parallel-size N`), and packed documents.

Megatron-Core's own CP runs only inside TE's attention. Here Megatron-Core's local
`DotProductAttention` (on fused attention's path, `--use-flash-attn`) runs MindSpeed's three
algorithms, `--context-parallel-algo`: `megatron_cp_algo` (ring, the default),
`ulysses_cp_algo` (all-to-all) and `hybrid_cp_algo` (Ulysses inside groups of
`--ulysses-degree-in-cp` ranks, ring across them), on one block-attention interface (features/attention/blocks.py)
over npuspeed's CPU kernels, PyTorch's, or npu_fusion_attention. Megatron's data split
(`get_batch_on_this_cp_rank`), RoPE per CP rank, loss and gradient reduction over DP x CP
and the distributed optimizer are Megatron's own. Packed documents (PackedSeqParams, built
by the example from EoD with --reset-attention-mask) run on the same path, with or without CP.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import Feature
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.context_parallel import patches as _patches, plan as _plan
from npuspeed.features.context_parallel import validate
from npuspeed.features.attention.cp_attention import ATTR
from npuspeed.features.attention.layout import ALGOS, CPLayout
from npuspeed.ops import flash_attention as cpu_flash


@dataclass(frozen=True)
class Config(FeatureConfig):
    context_parallel_size: int | None = flag("--context-parallel-size", None, type=int)
    """Megatron's CP size; with --transformer-impl local and --use-flash-attn npuspeed runs it (no
    Transformer Engine needed)."""
    context_parallel_algo: str | None = flag("--context-parallel-algo", None, choices=ALGOS)
    """CP algorithm (MindSpeed's names): megatron_cp_algo = ring attention (default), ulysses_cp_algo
    = all-to-all over heads, hybrid_cp_algo = Ulysses inside groups of --ulysses-degree-in-cp ranks,
    ring across them."""
    ulysses_degree_in_cp: int | None = flag("--ulysses-degree-in-cp", None, type=int)
    """With --context-parallel-algo hybrid_cp_algo: ranks per Ulysses group (divides
    --context-parallel-size)."""
    # fused_attention's flags (it owns them: no --help here), read for the checks CP needs of them
    use_flash_attn: bool = False
    pre_tockens: int | None = None
    next_tockens: int | None = None

    @property
    def algo(self) -> str:
        return self.context_parallel_algo or "megatron_cp_algo"

    def layout(self, size: int | None = None) -> CPLayout:
        return CPLayout.make(self.algo, size or self.context_parallel_size or 1, self.ulysses_degree_in_cp)


class ContextParallelFeature(Feature, name="context_parallel", Config=Config, patches=_patches, plan=_plan):
    def enabled(self, args: argparse.Namespace) -> bool:
        config = self.config(args)
        return (config.context_parallel_size or 1) > 1 or any(
            v is not None for v in (config.context_parallel_algo, config.ulysses_degree_in_cp))

    def layout(self, args) -> CPLayout:
        return self.config(args).layout()

    def validate(self, ctx) -> None:
        config = self.config(ctx.args)
        validate.check(ctx, config, config.layout())

    def prepare(self, ctx) -> None:
        if not for_device(ctx.accelerator.name).host_is_device():
            return
        if ctx.megatron.bf16 and cpu_flash.machine_reason():
            ctx.note("context parallelism: bf16 blocks run PyTorch's CPU flash kernel, not npuspeed's: "
                     f"{cpu_flash.machine_reason()}")
        if not ctx.megatron.bf16 and cpu_flash.fp32_reason():
            ctx.note("context parallelism: fp32 blocks run PyTorch's CPU flash kernel, not npuspeed's: "
                     f"{cpu_flash.fp32_reason()}")

    def check_built(self, block, ctx) -> str | None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        size = int(block.config.context_parallel_size or 1)
        given = self.config(ctx.args).context_parallel_size
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

    def running(self, ctx) -> str:
        config = self.config(ctx.args)
        cp = config.layout()
        what = {"ring": "ring attention: K/V blocks around the CP group (isend/irecv overlapped with each "
                        "block), partial outputs merged by log-sum-exp, dK/dV back around the ring",
                "ulysses": "Ulysses: all-to-all sequence -> heads before attention and back after",
                "hybrid": f"hybrid: Ulysses all-to-all in groups of {cp.ulysses}, ring across {cp.ring} groups"}
        traits = for_device(ctx.accelerator.name)
        kernel = ("npu_fusion_attention blocks" if traits.has_vendor_kernels() else
                  "PyTorch flash/efficient blocks" if traits.has_sdpa_kernels() else
                  "npuspeed::flash_attention(_fp32) blocks (PyTorch's CPU flash kernel where they cannot run)")
        size = config.context_parallel_size or "from the model config"
        return (f"{cp.algo} ({what[cp.short]}), CP {size}, Megatron's "
                f"load-balanced chunks; {kernel}; packed documents by PackedSeqParams")
