"""Block kernels on accelerators: `npu_fusion_attention` on NPU, PyTorch's flash/efficient on CUDA.

NPU: the op returns softmax_max and softmax_sum ([b, n, s, 8], the value repeated 8 times);
lse = max + log(sum). Its gradient op recomputes P from the max and sum it is given, so a
ring passes the final LSE as the max and ones as the sum (P = exp(s - lse)), with the final
output as `attention_in`. Causal diagonal blocks use the compressed 2048 x 2048 mask with
sparse_mode 2 (no S x S tensor). A block of packed documents is ONE call in the op's TND
(varlen) layout, each document piece a sequence of actual_seq_qlen / actual_seq_kvlen
(npuspeed/ops/npu/varlen.py), not one call per piece. The calls themselves are
npuspeed.ops.npu's (`lib`: torch_npu, or a test's stand-in).

CUDA: `_scaled_dot_product_flash_attention` (bf16/fp16) or
`_scaled_dot_product_efficient_attention` (fp32), both returning the LSE and taking it back
in backward. K/V heads are repeated for them (the raw ops have no GQA).

Neither draws dropout at global positions, so under CP they run with attention dropout 0
(the feature refuses dropout there at start-up); at CP 1 (packed documents) both draw it
per call and hand each call's state back to its own backward. On CUDA documents run tile by tile.
"""
from __future__ import annotations

import torch

from npuspeed.accelerator import npu_ops
from npuspeed.features.base import FeatureError
from npuspeed.features.attention.blocks import Block, BlockKernel, CallSpec, expand_kv, reduce_kv_grad
from npuspeed.ops.npu import attention as npu_attention
from npuspeed.ops.npu import varlen as npu_varlen

NPU = npu_ops.FUSION_ATTENTION
CUDA_FLASH, CUDA_EFFICIENT = "aten_flash_cuda", "aten_efficient_cuda"
_COMPRESSED = 2048


class NpuFusion(BlockKernel):
    """Dropout as CudaAten: the op draws its own mask (keep_prob) and returns its seed, offset
    and numels, which the grad op takes back; at CP 1 one draw per call (per_call_dropout)."""

    name = NPU
    varlen = True
    per_call_dropout = True

    def __init__(self, lib=None):
        self.lib = lib  # the op library (None: the loaded torch_npu)
        self._mask = None
        self._rng: dict[tuple, list] = {}

    def _compressed(self, device):
        if self._mask is None:
            self._mask = torch.ones(_COMPRESSED, _COMPRESSED, dtype=torch.bool, device=device).triu_(1)
        return self._mask

    def _mask_args(self, block: Block, device) -> dict:
        if not block.causal:
            return {"atten_mask": None, "sparse_mode": 0}
        return {"atten_mask": self._compressed(device), "sparse_mode": 2}

    def forward(self, q, k, v, block: Block, spec: CallSpec):
        keep = 1.0 - spec.dropout_p
        states = self._rng.setdefault(_place(q, k, block), []) if spec.dropout_p > 0 else None
        if block.tiles is not None:
            calls = [] if states is not None else None
            result = npu_varlen.forward(self.lib, q, k, v, block.causal, block.tiles, spec.scale,
                                        self._compressed(q.device), keep, calls)
            if states is not None:
                states.append(calls)
            return result
        sq, b, hq, d = q.shape
        sk, hk = k.shape[0], k.shape[2]
        res = npu_attention.sbh(self.lib, q.reshape(sq, b, hq * d), k.reshape(sk, b, hk * d),
                                v.reshape(sk, b, hk * d), hq, scale=spec.scale, keep_prob=keep,
                                mask_args=self._mask_args(block, q.device))
        if states is not None:
            states.append(npu_varlen.rng_kwargs(res))
        out, smax, ssum = res[0], res[1], res[2]
        lse = smax[..., 0] + torch.log(ssum[..., 0])  # [b, n, s]
        return out.view(sq, b, hq, d), lse.float()

    def backward(self, dout, q, k, v, out, lse, block: Block, spec: CallSpec):
        keep = 1.0 - spec.dropout_p
        state = self._rng[_place(q, k, block)].pop(0) if spec.dropout_p > 0 else None
        if block.tiles is not None:
            return npu_varlen.backward(self.lib, dout, q, k, v, out, lse, block.causal, block.tiles,
                                       spec.scale, self._compressed(q.device), keep, state)
        sq, b, hq, d = q.shape
        sk, hk = k.shape[0], k.shape[2]
        smax = lse.float().unsqueeze(-1).expand(b, hq, sq, 8).contiguous()
        grads = npu_attention.sbh_grad(
            self.lib, q.reshape(sq, b, hq * d), k.reshape(sk, b, hk * d), v.reshape(sk, b, hk * d),
            dout.reshape(sq, b, hq * d), hq, softmax_max=smax, attention_in=out.reshape(sq, b, hq * d),
            scale=spec.scale, keep_prob=keep, extra={**self._mask_args(block, q.device), **(state or {})})
        return grads[0].view_as(q), grads[1].view_as(k), grads[2].view_as(v)


def _place(q, k, block: Block) -> tuple:
    """Where a block call sits (its dropout state is handed back by place, first in first out)."""
    return block.q0, block.k0, q.shape[0], k.shape[0]


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 2, 0, 3)


class CudaAten(BlockKernel):
    """Flash for 16-bit inputs, memory-efficient for fp32 (flash has no fp32).

    Dropout: these kernels draw their own mask from the device generator and return its
    Philox seed/offset for backward; they cannot draw at global positions, so a CP ring runs
    them without dropout. At CP 1 (packed documents) every query row sees the keys of one
    tile only, so an independent draw per call is exactly Megatron's dropout: each forward
    call's seed/offset is kept, first in first out per tile place, for its backward.
    Dense calls pass no cumulative sequence lengths (None: an empty tensor would make the
    backward treat the call as varlen with batch size -1).
    """

    per_call_dropout = True

    def __init__(self, dtype: torch.dtype):
        self.flash = dtype in (torch.bfloat16, torch.float16)
        self.name = CUDA_FLASH if self.flash else CUDA_EFFICIENT
        if not self.flash and torch.are_deterministic_algorithms_enabled():
            raise FeatureError("--deterministic-mode: fp32 attention blocks on CUDA run PyTorch's memory-"
                               "efficient kernel, whose backward is not deterministic; train in --bf16 "
                               "(flash kernel) or drop --deterministic-mode")
        self._philox: dict[tuple, list] = {}

    def forward(self, q, k, v, block: Block, spec: CallSpec):
        groups = q.shape[2] // k.shape[2]
        qq, kk, vv = _bhsd(q), _bhsd(expand_kv(k, groups)), _bhsd(expand_kv(v, groups))
        if self.flash:
            res = torch.ops.aten._scaled_dot_product_flash_attention(qq, kk, vv, spec.dropout_p, block.causal, False,
                                                                     scale=spec.scale)
            out, lse, philox = res[0], res[1], (res[6], res[7])
        else:
            out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
                qq, kk, vv, None, True, spec.dropout_p, block.causal, scale=spec.scale)
            philox = (seed, offset)
        if spec.dropout_p > 0:
            self._philox.setdefault(_place(q, k, block), []).append(philox)
        return out.permute(2, 0, 1, 3), lse[..., : q.shape[0]].float()

    def _philox_for(self, q, k, block: Block, spec: CallSpec):
        if spec.dropout_p == 0:
            zero = torch.zeros((), dtype=torch.int64, device=q.device)
            return zero, zero
        return self._philox[_place(q, k, block)].pop(0)

    def backward(self, dout, q, k, v, out, lse, block: Block, spec: CallSpec):
        groups = q.shape[2] // k.shape[2]
        sq, sk = q.shape[0], k.shape[0]
        qq, kk, vv = _bhsd(q), _bhsd(expand_kv(k, groups)), _bhsd(expand_kv(v, groups))
        do, o = _bhsd(dout.contiguous()), _bhsd(out.contiguous())
        seed, offset = self._philox_for(q, k, block, spec)
        if self.flash:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                do, qq, kk, vv, o, lse.contiguous(), None, None, sq, sk, spec.dropout_p, block.causal, seed, offset,
                scale=spec.scale)
        else:
            padded = -(-sq // 32) * 32  # the efficient kernel's LSE rows are padded to 32
            lse_p = torch.nn.functional.pad(lse, (0, padded - sq)) if padded != sq else lse
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                do, qq, kk, vv, None, o, lse_p.contiguous(), seed, offset, spec.dropout_p, [True, True, True, False],
                block.causal, scale=spec.scale)
        back = lambda g: g.permute(2, 0, 1, 3)  # noqa: E731
        return back(dq), reduce_kv_grad(back(dk), groups), reduce_kv_grad(back(dv), groups)
