"""RMSNorm over the last dimension: y = x * rsqrt(mean(x^2) + eps) * weight.

`rms_norm` runs `npuspeed::rms_norm` on CPU (one pass each way, fp32 accumulation, see
csrc/cpu/rms_norm.cpp), `torch_npu.npu_rms_norm` on an NPU, and `rms_norm_reference`
otherwise. The weight must have the input's dtype for the C++ path (Megatron's case: the
module is cast with the model); mixed dtypes take the reference, which promotes as
torch.nn.RMSNorm does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from npuspeed.ops import _dispatch, fused_choice
from npuspeed.ops.npu import elementwise as npu_kernels

OP = "rms_norm"


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Pure PyTorch, computed in fp32 (fp64 for fp64) and rounded once to the output dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return y.to(x.dtype)
    return (y * weight.to(compute)).to(torch.promote_types(x.dtype, weight.dtype))


def _register() -> None:
    def setup_context(ctx, inputs, output):
        x, weight, _eps = inputs
        _y, rstd = output
        ctx.save_for_backward(x, weight, rstd)
        ctx.mark_non_differentiable(rstd)

    def backward(ctx, grad_y, _grad_rstd):
        x, weight, rstd = ctx.saved_tensors
        want_dw = ctx.needs_input_grad[1]
        dx, dw = torch.ops.npuspeed.rms_norm_backward(grad_y, x, weight, rstd, want_dw)
        return dx, (dw if want_dw else None), None

    torch.library.register_autograd("npuspeed::rms_norm", backward, setup_context=setup_context)

    @torch.library.register_fake("npuspeed::rms_norm")
    def _fake(x, weight, eps):
        acc = torch.promote_types(x.dtype, torch.float32)
        return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=acc)

    @torch.library.register_fake("npuspeed::rms_norm_backward")
    def _fake_bwd(grad, x, weight, rstd, weight_grad):
        return torch.empty_like(x), weight.new_empty(weight.shape if weight_grad else (0,))


def _cpp(x, weight, eps):
    _dispatch.ensure_registered(OP, _register)
    return torch.ops.npuspeed.rms_norm(x, weight, float(eps))[0]


def _npu(x, weight, eps):
    return npu_kernels.rms_norm(x, weight, eps)


#: the device kernel per implementation (`_dispatch.implementation`); else the reference
_KERNELS = {"cpp": _cpp, _dispatch.NPU_IMPL: _npu}


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm of `x` over its last dimension, scaled by `weight` (1-D, or None for none)."""
    if weight is None:
        weight = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    impl = _dispatch.implementation(OP, x, weight)
    _dispatch.record(OP, impl)
    return _KERNELS.get(impl, rms_norm_reference)(x, weight, eps)


def megatron_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What torch.nn.RMSNorm's forward runs (Megatron's norm with the flag off), as one
    module-level function: the `compile` candidate is torch.compile of it."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _liger(fn, eps):
    # Liger's "gemma" casting computes in fp32 and rounds once, as torch's F.rms_norm does;
    # offset 0 (plain weight); in_place=False: its backward must not write into the incoming grad
    return lambda x, w: fn.apply(x, w, eps, 0.0, "gemma", False)


def candidates(x: torch.Tensor, weight: torch.Tensor, eps: float, megatron) -> dict:
    """The implementations --use-fused-rmsnorm chooses among for this call, as fn(x, weight).

    `megatron(x, weight)` is what runs with the flag off (torch.nn.RMSNorm, i.e. torch's
    `F.rms_norm`: on CUDA and CPU that is also the device's native op, so it is not listed
    twice); npuspeed's C++ kernel on CPU, Triton on CUDA/NPU, torch_npu's kernel on an NPU;
    `compile`: torch.compile of the same F.rms_norm (fused_choice.compiled: accelerators by
    default); `liger`: Liger-Kernel's LigerRMSNormFunction where it is installed."""
    found = {"megatron": megatron}
    impl = _dispatch.implementation(OP, x, weight)
    kernel = _KERNELS.get(impl)
    if kernel is not None:
        found[impl] = lambda x, w: kernel(x, w, eps)
    triton = fused_choice.triton_kernel("rms_norm", "rms_norm", x, weight)
    if triton is not None:
        found["triton"] = lambda x, w: triton(x, w, eps)
    compiled = fused_choice.compiled(OP, megatron_rms_norm, x, weight)
    if compiled is not None:
        found["compile"] = lambda x, w: compiled(x, w, eps)
    liger = fused_choice.liger("rms_norm", x, weight) if x.dtype == weight.dtype else None
    if liger is not None:
        found["liger"] = _liger(liger, eps)
    return found


def call(x: torch.Tensor, weight: torch.Tensor, eps: float, megatron) -> dict:
    """The chooser's arguments for this call: what `fused_rms_norm` runs and the kernel table
    (npuspeed.ops.fused_table) times, one definition for both."""
    return dict(op=OP, candidates=candidates(x, weight, eps, megatron), inputs=(x, weight), extra=(float(eps),),
                rows=True)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, megatron) -> torch.Tensor:
    """--use-fused-rmsnorm's call: the fastest of `candidates`, measured once per shape."""
    return fused_choice.run_chosen(**call(x, weight, eps, megatron))
