"""--moe-grouped-gemm: Megatron-Core's own GroupedMLP, made to run on every backend.

Without Transformer Engine, `--moe-grouped-gemm` builds megatron.core's legacy `GroupedMLP`
(weight1 [H, E*F1], weight2 [E*F, H], viewed per expert). Upstream it needs the CUDA-only
`grouped_gemm` package (asserted at construction) and bf16 (asserted in forward). Here the
assertion accepts npuspeed's grouped mm (grouped_gemm.py) and the forward is replaced: the
same maths for fp32, bf16 and fp16, one grouped matmul per expert weight, SwiGLU times the
router probability in one fused op (npuspeed.ops.moe_swiglu), Megatron's `moe_act`
activation recompute kept. Its checkpoint layout is upstream's (interchangeable with
SequentialMLP's), untouched.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from npuspeed import telemetry
from npuspeed.features.moe_grouped_gemm.grouped_gemm import grouped_mm
from npuspeed.ops.moe_swiglu import weighted_swiglu

EXPERTS = "megatron.core.transformer.moe.experts"
MEGATRON_RANGE = ">=0.13,<0.17"  # forward(hidden, tokens_per_expert, permuted_probs) since 0.13
GG_UTIL = "megatron.core.transformer.moe.grouped_gemm_util"


def grouped_gemm_available() -> bool:
    """Replaces upstream's check for the CUDA `grouped_gemm` package: npuspeed provides one."""
    return True


def assert_grouped_gemm_available() -> None:
    """Replaces upstream's assertion that the CUDA `grouped_gemm` package is installed."""


def _fused_swiglu(config) -> bool:
    return (config.gated_linear_unit and config.activation_func is F.silu
            and not getattr(config, "glu_linear_offset", 0.0)
            and getattr(config, "activation_func_clamp_value", None) is None)


def _activation_with_probs(config, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """act(h) * probs in Megatron's arithmetic; SwiGLU as one fused op."""
    if _fused_swiglu(config):
        return weighted_swiglu(h, probs)
    if config.gated_linear_unit:
        a, b = torch.chunk(h, 2, dim=-1)
        act = config.activation_func(a) * (b + getattr(config, "glu_linear_offset", 0.0))
    else:
        act = config.activation_func(h)
    return (act * probs.unsqueeze(-1)).to(h.dtype)


def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
    """GroupedMLP.forward on any backend and dtype (upstream's asserts bf16 and needs CUDA)."""
    w1 = self.weight1.view(self.num_local_experts, self.config.hidden_size, -1)
    w2 = self.weight2.view(self.num_local_experts, -1, self.config.hidden_size)
    return grouped_forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, w1, w2)


def grouped_forward(self, x, tokens_per_expert, probs, w1, w2):
    """Experts as two grouped matmuls: w1 [G, H, F1] and w2 [G, F, H] (local experts' weights,
    input-major), SwiGLU x probability fused; `self.activation_recompute` keeps Megatron's
    `moe_act` recompute. Shared by GroupedMLP (<0.17) and npuspeed's grouped experts (0.17+)."""
    from megatron.core import tensor_parallel

    config = self.config
    if config.moe_apply_probs_on_input:
        assert config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
        x = (probs.unsqueeze(-1) * x).to(x.dtype)
        probs = torch.ones_like(probs)
    counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
    # Experts with no tokens get zero weight gradients from the grouped mm itself.
    sink1, sink2 = getattr(self, "npuspeed_grad_sinks", (None, None))
    fc1 = grouped_mm(x, w1, counts, sink=sink1)
    act = functools.partial(_activation_with_probs, config)
    if getattr(self, "activation_recompute", False):
        self.activation_checkpoint = tensor_parallel.CheckpointWithoutOutput()
        inter = self.activation_checkpoint.checkpoint(act, fc1, probs)
        out = grouped_mm(inter, w2, counts, sink=sink2)
        self.activation_checkpoint.discard_output_and_register_recompute(out)
    else:
        out = grouped_mm(act(fc1, probs), w2, counts, sink=sink2)
    return out, None


def count_built(init):
    """Counts GroupedMLPs built, so the report and the idle-flag check know one exists."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        telemetry.count("moe.grouped_mlp.built")

    return __init__
