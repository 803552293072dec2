"""The weight's "gradient" after a fused accumulation: a view of main_grad, not a new tensor.

Once the weight gradient is in `main_grad`, Megatron's layer still returns a gradient of the
weight's shape (`torch.empty`, never read) so that autograd runs the parameter's
AccumulateGrad node and with it the DDP hook (which must see `param.grad` under
--overlap-grad-reduce, and skips the add because `grad_added_to_main_grad` is set). That
placeholder is as large as the product the fusion saved, so the backward peak would not
fall. Here the layer's backward runs with `grad_added_to_main_grad` hidden (Megatron then
returns no weight gradient and allocates nothing); the wrapper restores the attribute, sets
it as Megatron would, and returns a view of main_grad's own storage reinterpreted in the
weight's dtype: autograd adopts it as `param.grad` without a copy (fresh view, same shape,
dtype and layout) and the DDP hook drops it. Its values are never read, like Megatron's.

The same wrapper routes a shape whose unfused path measured faster (or smaller) through
Megatron's own unfused backward, so "the flag loses here" costs nothing: the run is then
exactly the run without the flag for that layer.
"""
from __future__ import annotations

import functools

import torch

from npuspeed import telemetry
from npuspeed.features.grad_accum_fusion.candidates import PREFIX
from npuspeed.features.grad_accum_fusion.kernels import MM_ADD

TARGET = ("megatron.core.tensor_parallel.layers."
          "LinearWithGradAccumulationAndAsyncCommunication.backward")
ATTR = "grad_added_to_main_grad"
_MISSING = object()


def storage_view(main_grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """A fresh contiguous tensor of main_grad's shape in `dtype` over main_grad's storage
    (None where that cannot be: a wider dtype, or a non-contiguous main_grad)."""
    if not main_grad.is_contiguous() or torch.empty((), dtype=dtype).element_size() > main_grad.element_size():
        return None
    flat = main_grad.view(-1)
    if dtype != main_grad.dtype:
        flat = flat.view(dtype)
    return flat[: main_grad.numel()].view(main_grad.shape)


def _fused(ctx, weight) -> bool:
    """Megatron is about to accumulate this weight's gradient into main_grad. megatron-core
    0.17+ turns the fusion off inside this backward under GTP weight rematerialisation
    (`gtp_remat_size > 1`: the weight is a shard, its gradient reduce-scattered): not fused."""
    return (bool(getattr(ctx, "gradient_accumulation_fusion", False))
            and getattr(ctx, "gtp_remat_size", 1) <= 1
            and getattr(ctx, "main_grad", None) is not None and not hasattr(weight, "__fsdp_param__"))


def _viewable(weight) -> bool:
    """Megatron would return an uninitialised placeholder (not zeros: a tied weight's
    placeholder is summed with its other gradient, so it must stay Megatron's zeros)."""
    return hasattr(weight, ATTR) and not getattr(weight, "zero_out_wgrad", False)


def layer_backward(chooser, route: bool = True):
    """Wrapper factory for the layer's backward. `route`: ask `chooser` per shape whether the
    fused path runs at all (where the unfused one measured faster or smaller, Megatron's
    unfused backward runs, exactly as without the flag); off when apex's kernel is in use."""

    def wrap(backward):
        @functools.wraps(backward)
        def wrapped(ctx, grad_output, *rest):
            inp, weight = ctx.saved_tensors
            if not _fused(ctx, weight):
                return backward(ctx, grad_output, *rest)
            if route:
                rows = grad_output.numel() // grad_output.shape[-1]
                path = chooser.choose_shape(rows, grad_output.shape[-1], inp.shape[-1], inp.dtype, ctx.main_grad)
                if path == MM_ADD:
                    telemetry.count(PREFIX + "unfused_calls")
                    ctx.gradient_accumulation_fusion = False
                    try:
                        return backward(ctx, grad_output, *rest)
                    finally:
                        ctx.gradient_accumulation_fusion = True
            del inp
            if not _viewable(weight):
                return backward(ctx, grad_output, *rest)
            return _with_view(backward, ctx, weight, grad_output, *rest)

        return wrapped

    return wrap


def _with_view(backward, ctx, weight, *grad_outputs):
    before = getattr(weight, ATTR, _MISSING)
    delattr(weight, ATTR)
    try:
        grads = backward(ctx, *grad_outputs)
    finally:
        setattr(weight, ATTR, before)
    if grads[1] is not None:  # Megatron computed a real gradient: leave it
        return grads
    view = storage_view(ctx.main_grad, weight.dtype)
    if view is None:  # Megatron's own placeholder
        view = torch.empty(ctx.main_grad.shape, dtype=weight.dtype, device=ctx.main_grad.device)
    else:
        telemetry.count(PREFIX + "placeholder_views")
    setattr(weight, ATTR, True)
    return (grads[0], view, *grads[2:])
