"""Block kernels as ring attention uses them: two key blocks merged by LSE equal one attention,
and each block's backward from the *final* out/LSE sums to the full gradients.

Runs npuspeed's CPU kernel, PyTorch's CPU flash kernel and the NPU block kernel; no NPU
exists here, so the NPU kernel runs against the contract tier's torch_npu 2.14.0: the wheel's
schemas and meta functions around the documented-contract emulator (tests/npu_contract/;
the gradient recomputes P from softmax_max / softmax_sum and D from attention_in). It checks
npuspeed's wiring (layouts, LSE from max + log(sum), the final LSE passed back as max with
sum 1, masks), not the NPU.
"""
from __future__ import annotations

import pytest
import torch

from npu_contract import standin
from npuspeed.features.attention.blocks import Block, CallSpec
from npuspeed.features.attention.kernels_cpu import AtenCPU, NpuspeedCPU
from npuspeed.features.attention.kernels_device import NpuFusion
from npuspeed.features.attention.ring import _merge
from npuspeed.ops import flash_attention as cpu_flash


def _kernels():
    # torch_npu 2.14.0's schemas and meta functions around the emulator (the contract tier's stand-in)
    out = [("aten", AtenCPU()), ("npu-emulated", NpuFusion(standin.module("2.14.0")))]
    if cpu_flash.fp32_reason() is None:
        out.append(("npuspeed", NpuspeedCPU(torch.float32)))
    return out


@pytest.mark.parametrize("name,kernel", _kernels(), ids=[n for n, _ in _kernels()])
def test_two_blocks_merge_to_full_causal_attention(name, kernel):
    """Queries = the second half; keys = [first half (fully visible), second half (causal)]."""
    gen = torch.Generator().manual_seed(5)
    h, b, hq, hk, d = 8, 2, 4, 2, 16
    q = torch.randn(h, b, hq, d, generator=gen, requires_grad=True)
    k, v = (torch.randn(2 * h, b, hk, d, generator=gen, requires_grad=True) for _ in range(2))
    spec = CallSpec(scale=d ** -0.5)
    blocks = [(slice(0, h), Block(h, 0, False)), (slice(h, 2 * h), Block(h, h, True))]
    with torch.no_grad():
        outs = [kernel.forward(q, k[ks], v[ks], blk, spec) for ks, blk in blocks]
        out, lse = outs[0][0].float().clone(), outs[0][1].clone()
        _merge(out, lse, *outs[1])
    full = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3).double(), k.permute(1, 2, 0, 3).double().repeat_interleave(2, 1),
        v.permute(1, 2, 0, 3).double().repeat_interleave(2, 1),
        attn_mask=torch.ones(h, 2 * h, dtype=torch.bool).tril(h)).permute(2, 0, 1, 3)
    assert (out.double() - full).abs().max() < 1e-5
    dout = torch.randn(h, b, hq, d, generator=gen)
    full.backward(dout.double())
    dq = sum(kernel.backward(dout, q.detach(), k.detach()[ks], v.detach()[ks], out, lse, blk, spec)[0]
             for ks, blk in blocks)
    dk = torch.cat([kernel.backward(dout, q.detach(), k.detach()[ks], v.detach()[ks], out, lse, blk, spec)[1]
                    for ks, blk in blocks])
    assert (dq.double() - q.grad).abs().max() < 1e-5
    assert (dk.double() - k.grad).abs().max() < 1e-5


def test_bf16_block_on_the_fp32_kernel_when_the_bf16_one_cannot(monkeypatch):
    """No AVX512-BF16 (faked): bf16 blocks run npuspeed's fp32 kernel on copies, not PyTorch's."""
    from npuspeed.features.attention import kernels_cpu

    if cpu_flash.fp32_reason():
        pytest.skip(cpu_flash.fp32_reason())
    monkeypatch.setattr(kernels_cpu.cpu_flash, "unsupported", lambda *a, **k: "this CPU lacks AVX512-BF16")
    q, k = torch.randn(8, 1, 2, 16).bfloat16(), torch.randn(8, 1, 2, 16).bfloat16()
    kernel, why = kernels_cpu.cpu_kernel(q, k, 0.0)
    assert kernel.name == kernels_cpu.NPUSPEED_FP32 and kernel.upcast and "fp32 copies" in why
    out, lse = kernel.forward(q, k, k, Block(0, 0, True), CallSpec(scale=0.25))
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.float().permute(1, 2, 0, 3) for t in (q, k, k)),
                                                           is_causal=True, scale=0.25).permute(2, 0, 1, 3)
    assert out.dtype == torch.bfloat16 and (out.float() - ref).abs().max() < 1e-2
