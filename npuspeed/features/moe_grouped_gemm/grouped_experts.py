"""--moe-grouped-gemm on megatron-core 0.17+: npuspeed's own grouped experts module.

0.17 removed the legacy `GroupedMLP` (and `grouped_gemm_util`); without Transformer Engine
the local spec (`LocalSpecProvider.grouped_mlp_modules`) builds `SequentialMLP` whatever
`--moe-grouped-gemm` says. npuspeed's flag builds `GroupedSequentialMLP` there instead: a
SequentialMLP subclass whose parameters, state dict and sharded (checkpoint) layout are
SequentialMLP's own (`local_experts.<i>.linear_fc1/2.weight`, what 0.17+ saves for the local
spec), and whose forward runs the local experts as two grouped matmuls over their weights
stacked input-major (grouped_gemm.py, chosen per shape against one mm per expert), SwiGLU x
router probability fused, as GroupedMLP does on 0.13-0.16 (grouped_mlp.grouped_forward).
"""
from __future__ import annotations

import functools

import torch

from npuspeed import telemetry
from npuspeed.features.moe_grouped_gemm.grouped_mlp import grouped_forward

MEGATRON_RANGE = ">=0.17,<0.20"  # LocalSpecProvider.grouped_mlp_modules(moe_use_grouped_gemm) -> SequentialMLP
BACKENDS = "megatron.core.models.backends"
_CLASS: list = []


def grouped_class():
    """GroupedSequentialMLP, made once (megatron imported when the spec is built, not here)."""
    if _CLASS:
        return _CLASS[0]
    from megatron.core.transformer.moe.experts import SequentialMLP

    class GroupedSequentialMLP(SequentialMLP):
        """SequentialMLP's parameters and checkpoints; its experts run as grouped matmuls."""

        npuspeed_grouped = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            config = self.config
            self.activation_recompute = (config.recompute_granularity == "selective"
                                         and "moe_act" in (config.recompute_modules or ()))
            telemetry.count("moe.grouped_mlp.built")

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, **kwargs):
            if self.config.fp8 or self.config.fp4 or kwargs:  # quantized padding, zero-copy buffers
                return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs, **kwargs)
            # [G, H, F1] and [G, F, H]: the experts' [out, in] weights stacked input-major
            w1 = torch.stack([e.linear_fc1.weight.t() for e in self.local_experts])
            w2 = torch.stack([e.linear_fc2.weight.t() for e in self.local_experts])
            return grouped_forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, w1, w2)

    _CLASS.append(GroupedSequentialMLP)
    return GroupedSequentialMLP


def spec_wrapper(original):
    """The local backend's experts: npuspeed's grouped module when grouped GEMM is asked for."""

    @functools.wraps(original)
    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
        built = original(self, moe_use_grouped_gemm)
        if not moe_use_grouped_gemm:
            return built
        if not isinstance(built, functools.partial):
            raise TypeError(f"--moe-grouped-gemm: the local spec gave {built!r}, not a SequentialMLP partial; "
                            "npuspeed's grouped experts need megatron-core 0.17-0.19's LocalSpecProvider")
        return functools.partial(grouped_class(), *built.args, **built.keywords)

    return grouped_mlp_modules
