"""Ring attention: K/V blocks travel around the ring, partial outputs merge by log-sum-exp.

Forward, at step t a rank holds the K/V of ring position (p - t) mod R and has already
started sending it on (isend/irecv overlap this step's attention). Each (query segment, key
segment) pair is a block: masked when every key follows every query (skipped), the causal
diagonal, or fully visible (see layout.py for the segments). Block outputs merge exactly:
lse = logaddexp(lse, lse_b), out = out * exp(lse_old - lse) + out_b * exp(lse_b - lse).

Backward (FlashAttention-2 needs only the final out and LSE), dQ accumulates locally while
K/V travel the same way again; each block's dK/dV is added to an accumulator that travels
with them and, after R hops, arrives back at the rank that owns those K/V.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from npuspeed import telemetry
from npuspeed.features.attention import documents as docs_mod
from npuspeed.features.attention.blocks import Block, BlockKernel, CallSpec, tiled_backward, tiled_forward
from npuspeed.features.attention.comm import Exchange, RingPeers
from npuspeed.features.attention.layout import Segment, ring_segments

BLOCKS = "cp.blocks"  # block attention calls (forward), by kernel: cp.blocks.<kernel>


@dataclass
class RingPlan:
    peers: RingPeers | None  # None: a ring of one (Ulysses alone, or packed documents at CP 1)
    size: int
    position: int
    chunk: int  # tokens per coarse chunk (the sequence is 2 * size chunks)
    causal: bool
    kernel: BlockKernel
    spec: CallSpec
    docs: docs_mod.Documents | None = None

    def segments(self, position: int) -> tuple[Segment, ...]:
        return ring_segments(position, self.size, self.chunk)

    def blocks(self, owner: int):
        """(query segment, key segment, Block) of this rank's queries against `owner`'s K/V."""
        for qs in self.segments(self.position):
            for ks in self.segments(owner):
                if self.causal and ks.start >= qs.end:
                    continue  # every key after every query
                diag = self.causal and ks.start == qs.start
                if self.causal and not diag and ks.end > qs.start:
                    raise AssertionError(f"ring segments overlap partially: {qs} {ks}")
                block = Block(qs.start, ks.start, diag)
                if self.docs is not None:
                    if not diag and not docs_mod.visible(self.docs, qs.start, qs.length, ks.start, ks.length):
                        continue
                    if self.kernel.key_ranges:
                        block.key_lo, block.key_hi = docs_mod.ranges(self.docs, qs.start, qs.length, self.causal)
                    else:
                        block.tiles = docs_mod.tiles(self.docs, qs.start, qs.length, ks.start, ks.length)
                yield qs, ks, block


def _rows(x: torch.Tensor, seg: Segment) -> torch.Tensor:
    return x[seg.local:seg.local + seg.length]


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Merge block (o [s, b, h, d], lse_b [b, h, s]) into the accumulators (views), in place."""
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w_old = torch.exp(lse - safe).permute(2, 0, 1).unsqueeze(-1)
    w_new = torch.exp(lse_b - safe).permute(2, 0, 1).unsqueeze(-1)
    out.mul_(w_old).add_(o.float() * w_new)
    lse.copy_(new)


def _kv(plan: RingPlan, k, v):
    """K and V as one buffer to send around the ring (no copy for a ring of one)."""
    return torch.stack([k, v]) if plan.size > 1 else (k, v)


def _ring_forward(plan: RingPlan, q, k, v):
    kv = _kv(plan, k, v)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[2], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    seen: set[int] = set()  # query segments written once already
    for t in range(plan.size):
        pending = Exchange(plan.peers, kv) if t < plan.size - 1 else None
        owner = (plan.position - t) % plan.size
        for qs, ks, block in plan.blocks(owner):
            o, l = tiled_forward(plan.kernel, _rows(q, qs), _rows(kv[0], ks), _rows(kv[1], ks), block, plan.spec)
            telemetry.count(f"{BLOCKS}.{plan.kernel.name}")
            o_acc, l_acc = _rows(out, qs), lse[..., qs.local:qs.local + qs.length]
            if qs.local in seen:
                _merge(o_acc, l_acc, o, l)
            else:
                o_acc.copy_(o)
                l_acc.copy_(l)
                seen.add(qs.local)
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse


def _ring_backward(plan: RingPlan, dout, q, k, v, out, lse):
    kv = _kv(plan, k, v)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    incoming = None  # the dK/dV accumulator arriving from the previous rank
    for t in range(plan.size):
        pending = Exchange(plan.peers, kv) if t < plan.size - 1 else None
        owner = (plan.position - t) % plan.size
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)
        for qs, ks, block in plan.blocks(owner):
            ql = slice(qs.local, qs.local + qs.length)
            gq, gk, gv = tiled_backward(plan.kernel, dout[ql], q[ql], _rows(kv[0], ks), _rows(kv[1], ks),
                                        out[ql], lse[..., ql], block, plan.spec)
            dq[ql] += gq
            _rows(dkv[0], ks).add_(gk)
            _rows(dkv[1], ks).add_(gv)
        if incoming is not None:
            dkv += incoming.wait()
        if plan.size > 1:  # on to the next rank; the last hop brings it home
            incoming = Exchange(plan.peers, dkv, tag=1)
        if pending is not None:
            kv = pending.wait()
    if incoming is not None:
        dkv = incoming.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan):
        out, lse = _ring_forward(plan, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.plan, dout, q, k, v, out, lse)
        return dq, dk, dv, None
