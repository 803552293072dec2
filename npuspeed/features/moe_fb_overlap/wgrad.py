"""The routed experts' weight gradient split from their input gradient, computed while the
dispatch gradient's all-to-all is in flight.

In a layer's backward the experts' input gradient is what the dispatch's backward all-to-all
sends; their weight gradient nothing in that backward waits for. Between the token dispatch and
the token combine of a paired step (exchange.py, combine.py arm and disarm the thread) the
experts' matmuls take their weights detached (moe_common/deferred_wgrad.py): their backward
computes dX and owes dW; the dispatch gradient's `_Exchange.backward` launches its all-to-all,
runs the owed dW (`run_owed`), then passes the turn and waits. In the cool-down (the last
backward, no forward beside it) that compute is all that hides the transfer, as MindSpeed's
routed-expert dW does; in the steady phase it adds to the other micro-batch's forward.

Experts without Transformer Engine: the grouped experts (GroupedMLP 0.13-0.16, npuspeed's
GroupedSequentialMLP 0.17+) through grouped_gemm.grouped_mm; SequentialMLP's local linears
through `linear_with_grad_accumulation_and_async_allreduce`, replaced for expert weights at
expert-TP 1 (no sequence-parallel gather, no dgrad all-reduce) by `_SplitLinear`: Megatron's
matmuls, and for dW Megatron's branch (gradient-accumulation fusion into main_grad through the
layers module's `fused_weight_gradient_mlp_cuda` with its placeholder and
`grad_added_to_main_grad`, else the plain GEMM handed to autograd). Same kernels on the same
tensors: only when dW runs changes. NPUSPEED_FB_OVERLAP_WGRAD=joined keeps dW with dX.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys

import torch

from npuspeed import telemetry
from npuspeed.features.moe_common import deferred_wgrad
from npuspeed.patching.wrappers import bound_call

RANGE = ">=0.13,<0.20"  # a separate token_dispatch (the exchange that runs the owed dW) since 0.13
MODE_ENV = "NPUSPEED_FB_OVERLAP_WGRAD"
LAYERS = "megatron.core.tensor_parallel.layers"


def split_on() -> bool:
    mode = os.environ.get(MODE_ENV, "split")
    if mode not in ("split", "joined"):
        raise ValueError(f"{MODE_ENV}={mode!r}: use 'split' (the experts' dW inside the dispatch gradient's "
                         "all-to-all, the default) or 'joined' (dW with dX)")
    return mode == "split"


def arm() -> None:
    """After the token dispatch of a paired schedule's step (PP 1's, or the interleaved one's at
    PP > 1): the experts' matmuls owe their dW."""
    from npuspeed.features.moe_fb_overlap import schedule
    from npuspeed.features.pipeline import pairing

    if (schedule.current() is not None or pairing.pairing()) and split_on():
        deferred_wgrad.arm(True)


def disarm() -> None:
    deferred_wgrad.arm(False)


def run_owed() -> None:
    """Between the dispatch gradient's launch and its wait: the experts' owed dW."""
    if deferred_wgrad.owed():
        telemetry.count("moe.fb_overlap.wgrad.during_a2a", deferred_wgrad.run_owed())


def _linear_wgrad(param, total_input, grad_output, main_grad):
    """Megatron's weight-gradient branch of LinearWithGradAccumulationAndAsyncCommunication."""
    from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

    grad_output, total_input = prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
    if main_grad is None:
        return grad_output.t().matmul(total_input)
    param.main_grad = main_grad
    kernel = sys.modules[LAYERS].fused_weight_gradient_mlp_cuda
    if main_grad.dtype == torch.float32:
        kernel.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    else:
        kernel.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    placeholder = (torch.zeros if getattr(param, "zero_out_wgrad", False) else torch.empty)(
        main_grad.shape, dtype=total_input.dtype, device=main_grad.device)
    param.grad_added_to_main_grad = True
    return placeholder


class _SplitLinear(torch.autograd.Function):
    """Megatron's local linear at expert-TP 1 with the weight's gradient owed."""

    @staticmethod
    def forward(ctx, input_, weight, bias, later, main_grad):
        ctx.save_for_backward(input_, weight)
        ctx.later, ctx.main_grad, ctx.use_bias = later, main_grad, bias is not None
        output = torch.matmul(input_, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        ctx.later.owe(functools.partial(_linear_wgrad, ctx.later.target, input_, grad_output, ctx.main_grad))
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        return grad_input, None, grad_bias, None, None


def linear_wrapper(original):
    """Expert weights (Megatron marks them `allreduce=False`) at expert-TP 1 while armed:
    `_SplitLinear`; everything else Megatron's function."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def linear(*args, **kwargs):
        if not deferred_wgrad.armed():
            return original(*args, **kwargs)
        a = bound_call(signature, args, kwargs).arguments
        weight = a["weight"]
        plain = (not a["sequence_parallel"] and not a["allreduce_dgrad"] and a.get("grad_output_buffer") is None
                 and a.get("gtp_remat_size", 1) <= 1 and not hasattr(weight, "__fsdp_param__"))
        if not (plain and getattr(weight, "allreduce", True) is False):
            return original(*args, **kwargs)
        w, later = deferred_wgrad.split(weight)
        if later is None:
            return original(*args, **kwargs)
        fused = a["gradient_accumulation_fusion"] and hasattr(weight, "main_grad")
        if a["gradient_accumulation_fusion"] and not fused:
            return original(*args, **kwargs)
        telemetry.count("moe.fb_overlap.wgrad.split_linear")
        return _SplitLinear.apply(a["input"], w, a["bias"], later, weight.main_grad if fused else None)

    return linear
