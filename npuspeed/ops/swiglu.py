"""SwiGLU in Megatron's layout: x [..., 2F] -> silu(x[..., :F]) * x[..., F:].

`swiglu` runs `npuspeed::swiglu` on CPU (csrc/cpu/swiglu.cpp: one pass each way, the
sigmoid recomputed in backward from the saved input), `torch_npu.npu_swiglu` on an NPU,
and `swiglu_reference` (what Megatron's unfused MLP computes) otherwise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from npuspeed.ops import _dispatch, fused_choice
from npuspeed.ops.npu import elementwise as npu_kernels

OP = "swiglu"


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    a, b = torch.chunk(x, 2, dim=-1)
    return F.silu(a) * b


def _register() -> None:
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.ops.npuspeed.swiglu_backward(grad, x)

    torch.library.register_autograd("npuspeed::swiglu", backward, setup_context=setup_context)

    @torch.library.register_fake("npuspeed::swiglu")
    def _fake(x):
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))

    @torch.library.register_fake("npuspeed::swiglu_backward")
    def _fake_bwd(grad, x):
        return torch.empty_like(x)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * linear for x = [gate | linear] on the last dimension (which must be even)."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dimension must be even (gate and linear halves), got {tuple(x.shape)}")
    impl = _dispatch.implementation(OP, x)
    _dispatch.record(OP, impl)
    return _kernels().get(impl, swiglu_reference)(x)


def _cpp(x):
    _dispatch.ensure_registered(OP, _register)
    return torch.ops.npuspeed.swiglu(x)


def _npu(x):
    return npu_kernels.swiglu(x)


def _kernels() -> dict:
    """The device kernel per implementation (`_dispatch.implementation`); else the reference."""
    return {"cpp": _cpp, _dispatch.NPU_IMPL: _npu}


def candidates(x: torch.Tensor, megatron: dict) -> dict:
    """The implementations --use-fused-swiglu chooses among, as fn(x). `megatron` holds what
    runs with the flag off, by name: `megatron` (the MLP's eager silu(a) * b) and, where the
    config fused it, `megatron_fused` (Megatron's bias_swiglu_impl). torch has no native
    SwiGLU; torch_npu's `npu_swiglu` on an NPU, C++ on CPU, Triton on CUDA/NPU; `compile`:
    torch.compile of the same silu(a) * b (fused_choice.compiled: accelerators by default);
    `liger`: Liger-Kernel's LigerSiLUMulFunction where it is installed."""
    found = dict(megatron)
    if x.dim() == 0 or x.shape[-1] % 2:
        return found
    impl = _dispatch.implementation(OP, x)
    if impl in _kernels():
        found[impl] = _kernels()[impl]
    triton = fused_choice.triton_kernel("swiglu", "swiglu", x)
    if triton is not None:
        found["triton"] = triton
    compiled = fused_choice.compiled(OP, swiglu_reference, x)
    if compiled is not None:
        found["compile"] = compiled
    liger = fused_choice.liger("swiglu", x)
    if liger is not None:
        found["liger"] = lambda x: _liger(liger, x)
    return found


def _liger(fn, x: torch.Tensor) -> torch.Tensor:
    """Liger's LigerSiLUMulFunction(a, b) on Megatron's [gate | linear] halves. Its kernels
    address rows by one stride and its backward overwrites a and b with their gradients, so
    each half goes in as a contiguous copy of its own (never a view of the caller's tensor)."""
    a, b = torch.chunk(x, 2, dim=-1)
    return fn.apply(a.clone(memory_format=torch.contiguous_format), b.clone(memory_format=torch.contiguous_format))


def call(x: torch.Tensor, megatron: dict) -> dict:
    """The chooser's arguments for this call: what `fused_swiglu` runs and the kernel table
    (npuspeed.ops.fused_table) times, one definition for both."""
    return dict(op=OP, candidates=candidates(x, megatron), inputs=(x,), extra=tuple(sorted(megatron)), rows=True)


def fused_swiglu(x: torch.Tensor, megatron: dict) -> torch.Tensor:
    """--use-fused-swiglu's call: the fastest of `candidates`, measured once per shape."""
    return fused_choice.run_chosen(**call(x, megatron))

