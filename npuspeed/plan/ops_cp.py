"""Context-parallel core attention as the ops npuspeed's CP feature runs (for graph.py's replay).

Written from npuspeed/features/context_parallel (ring.py, ulysses.py, comm.py) at S/CP
tokens per rank (dims.py already splits the sequence):
- Ulysses (U > 1): q, and K/V stacked, go through an all-to-all (a contiguous send buffer, a
  receive buffer, then the ring-order index_select: a new tensor); the heads-sharded q and
  K/V are what the ring saves, so the layer's own q, k, v are freed; the output comes back
  through the inverse all-to-all (a new [s, b, h x d] tensor, linear_proj's saved input).
- Ring (R > 1): K and V stacked into one buffer that travels around the ring (one more in
  flight); an fp32 output accumulator; per block the kernel's output. Saved: q, k, v, the
  output (in the activation dtype) and an fp32 [b, heads, s] log-sum-exp. Backward: fp32
  dQ and two fp32 dK/dV accumulators (this step's and the one arriving), K/V in flight again.
- A ring of one (pure Ulysses) passes no K/V and stacks nothing.
"""
from __future__ import annotations

from npuspeed.plan.dims import Dims
from npuspeed.plan.graph import Op


def attention(g, d: Dims, q: str, k: str, v: str, out: str, ulysses: int, ring: int) -> None:
    a = d.act
    q_b = d.tokens * d.heads * d.head_dim * a
    kv_b = 2 * d.tokens * d.groups * d.head_dim * a  # K and V together
    lse = d.batch * d.heads * d.seq * 4
    if ulysses > 1:
        g.add(Op(f"{out}.a2a_q", (q,), {f"{out}.qh": q_b}, fwd_temp=2 * q_b, bwd_temp=2 * q_b))
        g.add(Op(f"{out}.a2a_kv", (k, v), {f"{out}.kvh": kv_b}, fwd_temp=3 * kv_b, bwd_temp=3 * kv_b))
        g.add(Op(f"{out}.kv_split", (f"{out}.kvh",), {f"{out}.kh": kv_b // 2, f"{out}.vh": kv_b // 2},
                 views={f"{out}.kh": f"{out}.kvh", f"{out}.vh": f"{out}.kvh"}))
        q, k, v = f"{out}.qh", f"{out}.kh", f"{out}.vh"
    travelling = 2 * kv_b if ring > 1 else 0  # the stacked K/V and the one arriving
    q32, kv32 = q_b * 4 // a, kv_b * 4 // a
    fwd_temp = q32 + travelling + q_b // max(ring, 1)
    bwd_temp = q32 + (2 * kv32 if ring > 1 else kv32) + travelling + q_b + kv_b
    o = f"{out}.o" if ulysses > 1 else out
    g.add(Op(f"{out}.ring", (q, k, v), {o: q_b}, saves=(q, k, v, o, f"{out}.lse"), extras={f"{out}.lse": lse},
             fwd_temp=fwd_temp, bwd_temp=bwd_temp, term="attention"))
    if ulysses > 1:
        g.add(Op(f"{out}.a2a_o", (o,), {out: q_b}, fwd_temp=q_b, bwd_temp=2 * q_b))


def comm_per_layer(d: Dims, ulysses: int, ring: int) -> dict:
    """Bytes one rank sends per layer and micro-batch, forward and backward: the ring passes
    K/V R-1 times each way and the fp32 dK/dV R times; each Ulysses all-to-all keeps 1/U."""
    a = d.act
    q_b = d.tokens * d.heads * d.head_dim * a
    kv_b = 2 * d.tokens * d.groups * d.head_dim * a
    out = 0.0
    if ulysses > 1:
        keep = (ulysses - 1) / ulysses
        out += 2 * keep * (q_b + kv_b + q_b)  # q, K/V in and the output back; the same in backward
    if ring > 1:
        out += 2 * (ring - 1) * kv_b + ring * kv_b * 4 // a
    return {"cp": out}
