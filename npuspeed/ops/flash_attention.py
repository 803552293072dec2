"""bf16 flash attention on CPU: `npuspeed::flash_attention` (csrc/cpu/flash_attention.cpp).

PyTorch's CPU flash kernel runs bf16 at about a third of the machine's bf16 GEMM speed; this
one tiles on AVX512-BF16 dot products and runs forward + backward about 2x faster (see
benchmarks/bench_attention.py), with fp32 sums throughout. It covers what Megatron's
causal LM layers need: bf16, causal (sq == sk) or unmasked, any GQA grouping, no dropout,
head dim a multiple of 16. `unsupported(...)` names what rules a call out, and the caller
then runs scaled_dot_product_attention.
"""
from __future__ import annotations

import functools

import torch

from npuspeed.ops import _dispatch
from npuspeed.ops._extension import has_op
from npuspeed.ops.build_flags import cpu_flags

OP = "flash_attention"


@functools.lru_cache(maxsize=None)
def machine_reason() -> str | None:
    """Why this process cannot run the kernel at all, or None when it can."""
    if not has_op(OP):
        return "the npuspeed C++ op library is not loaded (see `npuspeed report`)"
    if "avx512_bf16" not in cpu_flags():
        return "this CPU lacks AVX512-BF16"
    return None


def unsupported(query: torch.Tensor, key: torch.Tensor, *, causal: bool, masked: bool,
                dropout_p: float) -> str | None:
    """Why this call cannot run the kernel ([s, b, h, d] tensors), or None when it can."""
    reason = machine_reason()
    if reason:
        return reason
    if query.device.type != "cpu" or {query.dtype, key.dtype} != {torch.bfloat16}:
        return "it runs bf16 CPU tensors only"
    if masked:
        return "explicit or band masks go to scaled_dot_product_attention"
    if dropout_p > 0.0:
        return "attention dropout goes to scaled_dot_product_attention"
    if query.shape[-1] % 16:
        return f"head dim {query.shape[-1]} is not a multiple of 16"
    if causal and query.shape[0] != key.shape[0]:
        return "causal attention with sq != sk"
    return None


def _register() -> None:
    def setup_context(ctx, inputs, output):
        query, key, value, scale, causal = inputs
        ctx.save_for_backward(query, key, value, *output)
        ctx.scale, ctx.causal = scale, causal

    def backward(ctx, grad_out, _grad_lse):
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.npuspeed.flash_attention_backward(
            grad_out, query, key, value, out, lse, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None

    torch.library.register_autograd("npuspeed::flash_attention", backward, setup_context=setup_context)

    @torch.library.register_fake("npuspeed::flash_attention")
    def _fake(query, key, value, scale, causal):
        sq, b, hq, _ = query.shape
        return query.new_empty(query.shape), query.new_empty((b, hq, sq), dtype=torch.float32)

    @torch.library.register_fake("npuspeed::flash_attention_backward")
    def _fake_bwd(grad, query, key, value, out, lse, scale, causal):
        return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float,
                    causal: bool) -> torch.Tensor:
    """query [sq, b, hq, d], key/value [sk, b, hk, d] (bf16, CPU) -> context [sq, b, hq * d]."""
    reason = unsupported(query, key, causal=causal, masked=False, dropout_p=0.0)
    if reason:
        raise ValueError(f"npuspeed flash_attention cannot run this call: {reason}")
    _dispatch.ensure_registered(OP, _register)
    _dispatch.record(OP, "cpp")
    out, _lse = torch.ops.npuspeed.flash_attention(query, key, value, float(scale), bool(causal))
    sq, b, hq, d = out.shape
    return out.view(sq, b, hq * d)
