"""Megatron's tensor-parallel linear (LinearWithGradAccumulationAndAsyncCommunication) with its
three GEMMs in FP8 (npuspeed/ops/fp8): the same communication around them.

forward: all-gather the input over TP under sequence parallelism, y = FP8 GEMM (+ bias).
backward: dgrad FP8 GEMM, then all-reduce (allreduce_dgrad) or reduce-scatter (SP); wgrad FP8
GEMM over the gathered input, added into `weight.main_grad` under gradient-accumulation fusion
(with Megatron's dummy gradient when the weight has `grad_added_to_main_grad`), else returned.
The per-tensor recipes reduce their amaxes with MAX over the TP group (as TE does), so TP ranks
quantize a sharded tensor as TP1 quantizes the whole one. Communication is synchronous here.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from npuspeed.ops.fp8.linear import fp8_backward, fp8_forward


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    from megatron.core.tensor_parallel import layers

    out = torch.empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]), dtype=x.dtype, device=x.device)
    layers.dist_all_gather_func(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    from megatron.core.tensor_parallel import layers

    out = torch.empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]), dtype=x.dtype, device=x.device)
    layers.dist_reduce_scatter_func(out, x.contiguous(), group=group)
    return out


def amax_reducer(group):
    """MAX over the TP group (None when there is no group to reduce over)."""
    if group is None or dist.get_world_size(group) == 1:
        return None

    def reduce(amax: torch.Tensor) -> torch.Tensor:
        amax = amax.clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return amax
    return reduce


class Fp8TensorParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                tp_group, recipe, state, count):
        if recipe.per_tensor:
            recipe = dataclasses.replace(recipe, amax_reduce=amax_reducer(tp_group))
        total = _gather(input, tp_group) if sequence_parallel else input
        x2 = total.reshape(-1, total.shape[-1])
        y, ctx.saved = fp8_forward(x2, weight, recipe, state, count)
        if bias is not None:
            y = y + bias
        ctx.weight = weight
        ctx.main_grad = weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
        ctx.fusion, ctx.allreduce_dgrad, ctx.sp, ctx.group = (gradient_accumulation_fusion, allreduce_dgrad,
                                                              sequence_parallel, tp_group)
        ctx.total_shape, ctx.input_shape, ctx.has_bias = total.shape, input.shape, bias is not None
        return y.reshape(*total.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        weight = ctx.weight
        dy2 = grad_output.reshape(-1, grad_output.shape[-1])
        fused = ctx.fusion and ctx.main_grad is not None
        dw_dtype = ctx.main_grad.dtype if fused else weight.dtype
        dx, dw = fp8_backward(dy2, ctx.saved, dw_dtype)
        ctx.saved = None
        dx = dx.reshape(ctx.total_shape)
        if ctx.sp:
            dx = _reduce_scatter(dx, ctx.group)
        elif ctx.allreduce_dgrad:
            dist.all_reduce(dx, group=ctx.group)
        if fused:
            weight.main_grad = ctx.main_grad
            weight.main_grad.add_(dw)
            if hasattr(weight, "grad_added_to_main_grad"):
                make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
                grad_weight = make(weight.main_grad.shape, dtype=grad_output.dtype, device=grad_output.device)
                weight.grad_added_to_main_grad = True
            else:
                grad_weight = None
        else:
            grad_weight = dw
        grad_bias = dy2.sum(0) if ctx.has_bias else None
        ctx.weight = ctx.main_grad = None
        return dx, grad_weight, grad_bias, None, None, None, None, None, None, None
