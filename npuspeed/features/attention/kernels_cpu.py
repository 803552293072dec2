"""Block kernels on CPU: npuspeed's flash kernels, and PyTorch's CPU flash kernel as the fallback.

npuspeed's kernels (`npuspeed::flash_attention` bf16, `npuspeed::flash_attention_fp32`) return
(out, lse), take the final out/lse in backward, compare causal at global positions, take
per-row key ranges (documents) and draw dropout at global (row, column, head): everything a
ring block needs (bf16 without AVX512-BF16 runs the fp32 kernel on fp32 copies). PyTorch's
`_scaled_dot_product_flash_attention_for_cpu` (+ its backward) also returns the LSE; it runs
where npuspeed's kernels cannot (the C++ library is not loaded, fp16), without native GQA (K/V heads are repeated for it),
without dropout, and with documents tile by tile.
"""
from __future__ import annotations

import torch

from npuspeed.features.attention.blocks import Block, BlockKernel, CallSpec, expand_kv, reduce_kv_grad
from npuspeed.ops import flash_attention as cpu_flash

NPUSPEED_BF16 = "npuspeed_flash_bf16"  # the same labels as fused attention's own calls
NPUSPEED_FP32 = "npuspeed_flash_fp32"
ATEN_CPU = "aten_flash_cpu"


class NpuspeedCPU(BlockKernel):
    """`upcast`: bf16 blocks the bf16 kernel cannot take run the fp32 kernel on fp32 copies
    (as fused attention does at CP 1), O(S x d) extra, results cast back."""

    key_ranges = True
    dropout = True

    def __init__(self, dtype: torch.dtype, upcast: bool = False):
        self.upcast = upcast
        self.name = NPUSPEED_BF16 if dtype == torch.bfloat16 and not upcast else NPUSPEED_FP32

    @staticmethod
    def _params(block: Block, spec: CallSpec):
        return cpu_flash.FlashParams(scale=spec.scale, causal=block.causal, dropout_p=spec.dropout_p,
                                     seed=spec.seed, offset=spec.offset, q_pos0=block.q0, k_pos0=block.k0,
                                     head0=spec.head0)

    def forward(self, q, k, v, block: Block, spec: CallSpec):
        if self.upcast:
            out, lse = cpu_flash.forward(q.float(), k.float(), v.float(), self._params(block, spec), block.key_lo,
                                         block.key_hi)
            return out.to(q.dtype), lse
        return cpu_flash.forward(q, k, v, self._params(block, spec), block.key_lo, block.key_hi)

    def backward(self, dout, q, k, v, out, lse, block: Block, spec: CallSpec):
        if self.upcast:
            grads = cpu_flash.backward(dout.float().contiguous(), q.float(), k.float(), v.float(),
                                       out.float().contiguous(), lse.contiguous(), self._params(block, spec),
                                       block.key_lo, block.key_hi)
            return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))
        return cpu_flash.backward(dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(),
                                  self._params(block, spec), block.key_lo, block.key_hi)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 2, 0, 3)


class AtenCPU(BlockKernel):
    name = ATEN_CPU

    def forward(self, q, k, v, block: Block, spec: CallSpec):
        groups = q.shape[2] // k.shape[2]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(expand_kv(k, groups)), _bhsd(expand_kv(v, groups)), 0.0, block.causal,
            scale=spec.scale)
        return out.permute(2, 0, 1, 3), lse.float()

    def backward(self, dout, q, k, v, out, lse, block: Block, spec: CallSpec):
        groups = q.shape[2] // k.shape[2]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout.contiguous()), _bhsd(q), _bhsd(expand_kv(k, groups)), _bhsd(expand_kv(v, groups)),
            _bhsd(out.contiguous()), lse.contiguous(), 0.0, block.causal, scale=spec.scale)
        back = lambda g: g.permute(2, 0, 1, 3)  # noqa: E731
        return back(dq), reduce_kv_grad(back(dk), groups), reduce_kv_grad(back(dv), groups)


def cpu_kernel(q: torch.Tensor, k: torch.Tensor, dropout_p: float) -> tuple[BlockKernel, str]:
    """npuspeed's kernel for this call when it can run it, else PyTorch's; and why."""
    reason = cpu_flash.unsupported(q, k, masked=False, dropout_p=dropout_p)
    if reason is None:
        return NpuspeedCPU(q.dtype), f"npuspeed's {str(q.dtype).replace('torch.', '')} CPU kernel"
    if q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16 and cpu_flash.fp32_reason() is None \
            and 0.0 <= dropout_p < 1.0:
        return NpuspeedCPU(q.dtype, upcast=True), f"npuspeed's fp32 CPU kernel on fp32 copies ({reason})"
    return AtenCPU(), f"PyTorch's CPU flash kernel ({reason})"
