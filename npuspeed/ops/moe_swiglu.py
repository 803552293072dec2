"""SwiGLU scaled by each row's router probability, the grouped expert MLP's activation:
x [N, 2F] = [gate | linear], probs [N] -> silu(gate) * linear * probs [N, F].

`weighted_swiglu` runs `npuspeed::moe_weighted_swiglu` on CPU (csrc/cpu/moe_swiglu.cpp: one
pass each way in fp32, the probability gradient reduced in the same pass), torch_npu's
`npu_swiglu` times the probabilities on an NPU, and `weighted_swiglu_reference` (Megatron's
expert MLP: glu, then an fp32 scale, then a cast back) otherwise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from npuspeed.ops import _dispatch
from npuspeed.ops.npu import elementwise as npu_kernels

OP = "moe_weighted_swiglu"


def weighted_swiglu_reference(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    a, b = torch.chunk(x, 2, dim=-1)
    return (F.silu(a) * b * probs.unsqueeze(-1)).to(x.dtype)


def _register() -> None:
    def setup_context(ctx, inputs, output):
        x, probs = inputs
        ctx.probs_grad = probs.requires_grad
        ctx.save_for_backward(x, probs)

    def backward(ctx, grad):
        x, probs = ctx.saved_tensors
        dx, dp = torch.ops.npuspeed.moe_weighted_swiglu_backward(grad, x, probs, ctx.probs_grad)
        return dx, (dp.view_as(probs) if ctx.probs_grad else None)

    torch.library.register_autograd("npuspeed::moe_weighted_swiglu", backward, setup_context=setup_context)

    @torch.library.register_fake("npuspeed::moe_weighted_swiglu")
    def _fake(x, probs):
        return x.new_empty(x.shape[0], x.shape[1] // 2)

    @torch.library.register_fake("npuspeed::moe_weighted_swiglu_backward")
    def _fake_bwd(grad, x, probs, probs_grad):
        return torch.empty_like(x), probs.new_empty(x.shape[0] if probs_grad else 0)


def implementation(x: torch.Tensor) -> str:
    if _dispatch.on_npu(x):
        return _dispatch.NPU_IMPL
    if _dispatch.on_host(x) and x.dtype in _dispatch.CPP_DTYPES and _dispatch.has_op(OP):
        return "cpp"
    return "reference"


def weighted_swiglu(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :F]) * x[:, F:] * probs[:, None] for x [N, 2F] and probs [N]."""
    if x.dim() != 2 or x.shape[-1] % 2:
        raise ValueError(f"weighted_swiglu: input must be [rows, 2F], got {tuple(x.shape)}")
    impl = implementation(x)
    _dispatch.record(OP, impl)
    if impl == "cpp":
        _dispatch.ensure_registered(OP, _register)
        return torch.ops.npuspeed.moe_weighted_swiglu(x, probs)
    if impl == _dispatch.NPU_IMPL:
        return (npu_kernels.swiglu(x) * probs.unsqueeze(-1)).to(x.dtype)
    return weighted_swiglu_reference(x, probs)
