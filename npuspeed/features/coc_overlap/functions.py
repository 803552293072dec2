"""Forward and backward of the tensor-parallel linears, chunked (autograd functions).

Column (Y = X W^T + b, W split by rows of W):
  SP     forward  Y = all_gather(x) W^T            -> engine.ag_mm
         backward dx = reduce_scatter(dY W)         -> engine.mm_rs, while all_gather(x) for dW
                                                       runs (re-gathered as Megatron does: the
                                                       gathered input is not kept between passes)
  no SP  forward  Y = x W^T (no collective)
         backward dx = all_reduce(dY W)             -> engine.mm_ar, overlapping dW
Row (Y = X W^T, W split by columns; bias is added by the module after the collective):
  SP     forward  Y = reduce_scatter(x W^T)         -> engine.mm_rs
         backward dx = all_gather(dY) W, dW from the gathered dY  -> engine.ag_mm
  no SP  forward  Y = all_reduce(x W^T)             -> engine.mm_ar
         backward local matmuls (the all-reduce's gradient is the identity)

The weight gradient is one matmul over all rows, as in Megatron. With
`gradient_accumulation_fusion` it is accumulated into `weight.main_grad` the way Megatron
does (its fused kernel when present) and a dummy grad is returned when the parameter has
`grad_added_to_main_grad`, so Megatron's DDP hook does not add it again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from npuspeed import telemetry
from npuspeed.features.coc_overlap.comm import CALL, gather_buffer


@dataclass(frozen=True)
class LinearSpec:
    engine: object  # ChunkedEngine or Mc2Engine
    sequence_parallel: bool
    allreduce_dgrad: bool = False  # column without SP: all-reduce the input gradient
    gradient_accumulation_fusion: bool = False


def _fused_wgrad_kernel():
    """Megatron's own gradient-accumulation kernel module when it imported (apex), else None."""
    from megatron.core.tensor_parallel import layers

    return getattr(layers, "fused_weight_gradient_mlp_cuda", None)


def weight_grad(ctx, weight: torch.Tensor, grad_out: torch.Tensor, inp: torch.Tensor):
    """dW = dY^T X ([n, rows] x [rows, k]); into main_grad under gradient accumulation fusion."""
    if not (ctx.gradient_accumulation_fusion and ctx.main_grad is not None):
        return grad_out.t().matmul(inp)
    weight.main_grad = ctx.main_grad
    if hasattr(weight, "__fsdp_param__"):
        weight.main_grad = weight.get_main_grad()
        torch.matmul(grad_out.t(), inp, out=weight.main_grad)
    else:
        main_grad, kernel = weight.main_grad, _fused_wgrad_kernel()
        if kernel is not None and main_grad.dtype == torch.float32:
            kernel.wgrad_gemm_accum_fp32(inp, grad_out, main_grad)
        elif kernel is not None and main_grad.dtype in (torch.float16, torch.bfloat16):
            kernel.wgrad_gemm_accum_fp16(inp, grad_out, main_grad)
        else:
            main_grad.addmm_(grad_out.t().to(main_grad.dtype), inp.to(main_grad.dtype))
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    # Megatron's DDP hook skips params whose grad is already in main_grad.
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    weight.grad_added_to_main_grad = True
    return make(weight.main_grad.shape, dtype=inp.dtype, device=inp.device, requires_grad=False)


def _save(ctx, spec: LinearSpec, inp, weight):
    ctx.save_for_backward(inp, weight)
    ctx.spec = spec
    ctx.gradient_accumulation_fusion = spec.gradient_accumulation_fusion
    ctx.main_grad = getattr(weight, "main_grad", None) if spec.gradient_accumulation_fusion else None


class ColumnLinear(torch.autograd.Function):
    """Column-parallel linear on 2-D [rows, k] input: chunked all-gather+matmul (SP) / chunked
    dgrad collectives. Outputs are fresh tensors (callers reshape outside the function)."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, spec: LinearSpec):
        _save(ctx, spec, x2d, weight)
        ctx.use_bias = bias is not None
        if spec.sequence_parallel:
            telemetry.count(CALL + "column_sp.forward")
            out, _ = spec.engine.ag_mm(x2d, weight.t())
        else:
            telemetry.count(CALL + "column_ar.forward")
            out = torch.matmul(x2d, weight.t())
        if bias is not None:
            out = out + bias
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x2d, weight = ctx.saved_tensors
        spec, comm = ctx.spec, ctx.spec.engine.comm
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        telemetry.count(CALL + ("column_sp" if spec.sequence_parallel else "column_ar") + ".backward")
        g2d = grad_output.contiguous()
        gather = None
        if need_dw and spec.sequence_parallel:  # re-gather x for dW, under the dgrad matmuls
            total = gather_buffer((x2d.shape[0] * comm.size, x2d.shape[1]), x2d)
            gather = comm.all_gather(total, x2d.contiguous())
        dgrad = None
        if need_dx:
            dgrad = spec.engine.mm_rs(g2d, weight) if spec.sequence_parallel else spec.engine.mm_ar(g2d, weight)
        grad_weight = None
        if need_dw:
            total_input = gather.wait() if gather is not None else x2d
            grad_weight = weight_grad(ctx, weight, g2d, total_input)
        grad_bias = g2d.sum(dim=0) if ctx.use_bias else None
        grad_input = dgrad.wait() if dgrad is not None else None
        return grad_input, grad_weight, grad_bias, None


class RowLinear(torch.autograd.Function):
    """Row-parallel linear and its collective on 2-D input: chunked matmul+reduce-scatter /
    matmul+all-reduce. Outputs are fresh tensors."""

    @staticmethod
    def forward(ctx, x2d, weight, spec: LinearSpec):
        _save(ctx, spec, x2d, weight)
        if spec.sequence_parallel:
            telemetry.count(CALL + "row_sp.forward")
            return spec.engine.mm_rs(x2d, weight.t()).wait()
        telemetry.count(CALL + "row_ar.forward")
        return spec.engine.mm_ar(x2d, weight.t()).wait()

    @staticmethod
    def backward(ctx, grad_output):
        x2d, weight = ctx.saved_tensors
        spec = ctx.spec
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g2d = grad_output.contiguous()
        grad_input = grad_weight = None
        if spec.sequence_parallel:
            telemetry.count(CALL + "row_sp.backward")
            if need_dx:
                grad_input, g_full = spec.engine.ag_mm(g2d, weight, keep_gathered=need_dw)
            elif need_dw:  # frozen input: only dW needs the gathered gradient
                g_full = g2d.new_empty(g2d.shape[0] * spec.engine.comm.size, g2d.shape[1])
                spec.engine.comm.all_gather(g_full, g2d).wait()
        else:
            telemetry.count(CALL + "row_ar.backward")
            g_full = g2d
            grad_input = g2d.matmul(weight) if need_dx else None
        if need_dw:
            grad_weight = weight_grad(ctx, weight, g_full, x2d)
        return grad_input, grad_weight, None
