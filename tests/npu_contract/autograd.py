"""Autograd for the stand-in's differentiable ops, as torch_npu gives it: fused attention through
npu_fusion_attention_grad (fed the forward's outputs), the others through the emulator's own
derivative. torch.library.register_autograd refuses ops with keyword-only tensors (torch_npu's
permute has `*, Tensor? probs`), so an Autograd-key kernel wraps a torch.autograd.Function.
"""
from __future__ import annotations

import torch

#: the grad op's arguments that the forward's outputs fill (torch_npu's derivative formula)
_FA_FROM_OUTPUT = {"attention_in": 0, "softmax_max": 1, "softmax_sum": 2, "softmax_in": 3,
                   "seed": 4, "offset": 5, "numels": 6}


def _grads_by_grad_op(release, kernel, bound, output, grads):
    """npu_fusion_attention: backward through npu_fusion_attention_grad, as torch_npu's own."""
    from npu_contract.standin import namespace

    ops = getattr(torch.ops, namespace(release))
    grad_schema = ops.npu_fusion_attention_grad.default._schema
    kwargs = {}
    for arg in grad_schema.arguments[6:]:
        if arg.name in _FA_FROM_OUTPUT:
            kwargs[arg.name] = output[_FA_FROM_OUTPUT[arg.name]]
        elif arg.name == "scale_value":
            kwargs[arg.name] = bound["scale"]
        elif arg.name in bound:
            kwargs[arg.name] = bound[arg.name]
    got = ops.npu_fusion_attention_grad(bound["query"], bound["key"], bound["value"], grads[0].contiguous(),
                                        bound["head_num"], bound["input_layout"], **kwargs)
    return {"query": got[0], "key": got[1], "value": got[2]}


def _grads_by_emulator(kernel, bound, output, grads):  # noqa: ARG001 (output: the grad-op form's)
    """Other differentiable ops: the emulator's own derivative, recomputed."""
    leaves = {n: v.detach().requires_grad_(True) for n, v in bound.items()
              if isinstance(v, torch.Tensor) and v.is_floating_point()}
    with torch.enable_grad():
        out = kernel.emulator(**{n: leaves.get(n, v) for n, v in bound.items() if n in kernel.declared})
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    pairs = [(o, g) for o, g in zip(outs, grads)
             if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
    if not pairs:
        return {}
    found = torch.autograd.grad([o for o, _ in pairs], list(leaves.values()), [g for _, g in pairs],
                                allow_unused=True)
    return dict(zip(leaves, found))


class _Differentiate(torch.autograd.Function):
    """One call of a differentiable op: forward below autograd, backward as `grads_of` says.
    (torch.library.register_autograd refuses ops with keyword-only tensors, which torch_npu has.)"""

    @staticmethod
    def forward(ctx, call, grads_of, names, *tensors):
        with torch._C._AutoDispatchBelowAutograd():
            output = call()
        ctx.grads_of, ctx.names, ctx.output = grads_of, names, output
        return output

    @staticmethod
    def backward(ctx, *grads):
        by_name = ctx.grads_of(ctx.output, grads)
        return (None, None, None, *(by_name.get(n) for n in ctx.names))


def kernel(release, op_kernel, op):
    """The Autograd-key kernel of `op` (whose CPU kernel is `op_kernel`)."""
    from npu_contract.standin import bind

    kernel = op_kernel

    def run(*args, **kwargs):
        bound = bind(kernel.schema, args, kwargs)
        names = [n for n, v in bound.items() if isinstance(v, torch.Tensor)]
        if name_is_attention:
            grads_of = lambda output, grads: _grads_by_grad_op(release, kernel, bound, output, grads)  # noqa: E731
        else:
            grads_of = lambda output, grads: _grads_by_emulator(kernel, bound, output, grads)  # noqa: E731
        return _Differentiate.apply(lambda: op(*args, **kwargs), grads_of, names, *(bound[n] for n in names))

    name_is_attention = kernel.name == "npu_fusion_attention"
    return run
