"""The block-attention interface: one attention over a block of queries and keys, with its LSE.

Ring attention needs, per block, the output and the per-row log-sum-exp (to merge partial
outputs exactly) and a backward that takes the *final* merged output and LSE (FlashAttention-2's
backward needs only those). Each kernel that can do that is a `BlockKernel`; `choose()` picks
one per call. A new kernel (an fp32 or varlen CPU kernel, a new NPU op) is one more class here.

Shapes: q [sq, b, hq, d], k/v [sk, b, hk, d] (Megatron's layout; hq % hk == 0 is GQA);
out [sq, b, hq, d] in q's dtype; lse [b, hq, sq] fp32, -inf for a row that sees no key (its
output is 0). A `Block` says where the rows sit in the global sequence; `CallSpec` what every
block of one attention call shares.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CallSpec:
    scale: float
    dropout_p: float = 0.0
    seed: int = 0
    offset: int = 0
    head0: int = 0  # global index of local query head 0 (dropout is drawn per global head)


@dataclass
class Block:
    """Queries at global positions [q0, q0 + sq), keys at [k0, k0 + sk).

    causal: the diagonal block of a causal layer (q0 == k0, sq == sk); else every key is
    visible, except what the documents exclude: key_lo / key_hi (int32 [b, sq], global key
    positions a row may see) for kernels that take ranges, `tiles` for the others (run one
    call per tile, or one call for all of them by a `varlen` kernel)."""

    q0: int
    k0: int
    causal: bool
    key_lo: torch.Tensor | None = None
    key_hi: torch.Tensor | None = None
    #: per batch row, (q_begin, q_end, k_begin, k_end) local index ranges: each a dense
    #: sub-block (causal when the block is) of one document; None = the whole block is one
    tiles: list | None = None


class BlockKernel:
    name = ""
    #: takes per-row key ranges (documents) itself; else documents run tile by tile
    key_ranges = False
    #: takes a block's document pieces (`Block.tiles`) in one call itself (NPU's TND layout)
    varlen = False
    #: draws attention dropout from (seed, offset, global positions, global head): the same
    #: mask whatever the CP layout, so a block may drop out
    dropout = False
    #: draws dropout itself, independently per call (a device kernel's own generator): right
    #: only where no output row merges blocks, i.e. a ring of one (CP 1, packed documents)
    per_call_dropout = False

    def forward(self, q, k, v, block: Block, spec: CallSpec):
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, block: Block, spec: CallSpec):
        raise NotImplementedError


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[s, b, hk, d] -> [s, b, hk * groups, d] (for kernels without native GQA)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def reduce_kv_grad(g: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `expand_kv`: sum each group's heads."""
    if groups == 1:
        return g
    s, b, h, d = g.shape
    return g.view(s, b, h // groups, groups, d).sum(dim=3)


def _empty_outputs(q: torch.Tensor):
    sq, b, hq, _ = q.shape
    return torch.zeros_like(q), torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)


def tiled_forward(kernel: BlockKernel, q, k, v, block: Block, spec: CallSpec):
    """`kernel.forward` over a block whose documents it cannot take: one dense call per tile
    (a `varlen` kernel gets the tiles and makes one call)."""
    if block.tiles is None or kernel.varlen:
        return kernel.forward(q, k, v, block, spec)
    out, lse = _empty_outputs(q)
    for row, tiles in enumerate(block.tiles):
        for qa, qb, ka, kb in tiles:
            sub = Block(block.q0 + qa, block.k0 + ka, block.causal)
            o, l = kernel.forward(q[qa:qb, row:row + 1], k[ka:kb, row:row + 1], v[ka:kb, row:row + 1], sub, spec)
            out[qa:qb, row:row + 1] = o
            lse[row:row + 1, :, qa:qb] = l
    return out, lse


def tiled_backward(kernel: BlockKernel, dout, q, k, v, out, lse, block: Block, spec: CallSpec):
    if block.tiles is None or kernel.varlen:
        return kernel.backward(dout, q, k, v, out, lse, block, spec)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for row, tiles in enumerate(block.tiles):
        r = slice(row, row + 1)
        for qa, qb, ka, kb in tiles:
            sub = Block(block.q0 + qa, block.k0 + ka, block.causal)
            gq, gk, gv = kernel.backward(dout[qa:qb, r], q[qa:qb, r], k[ka:kb, r], v[ka:kb, r], out[qa:qb, r],
                                         lse[r, :, qa:qb].contiguous(), sub, spec)
            dq[qa:qb, r] += gq
            dk[ka:kb, r] += gk
            dv[ka:kb, r] += gv
    return dq, dk, dv
