"""Megatron-Core 0.16's MoE layer (local spec, all-to-all dispatcher) as ops for graph.py.

Replaces the dense MLP of every layer when the model has experts. Per rank, for t local
tokens routed to k experts each (t x k rows, the even share: the router of a trained or
random model spreads them; capacity factors cap them), E experts, E / EP local ones:
- router: a [t, E] linear (saves its input, the norm output, as the dense fc1 did), the
  softmax in fp32 (saved), top-k: sparse fp32 probabilities and a boolean routing map;
- permute (unfused: index_select by a sorted index, which backward keeps; fused permute:
  npuspeed's op, the same tensors) -> [t k, h]; the EP all-to-all -> a new [t k, h]; with
  several local experts a chunk sort -> another (none of them saved);
- experts: SequentialMLP runs each local expert's MLP on its rows (fc1 saves its input,
  the activation its input, the fp32 probability product its factors, fc2 its input, the
  product cast back); GroupedMLP (--moe-grouped-gemm) the same tensors as one grouped mm
  per weight, the SwiGLU x probability fused (saves fc1's output only);
- combine: the chunk sort back, the all-to-all back, unpermute (scatter-add into [t, h]).
EP all-to-alls move t k h activation bytes each way per direction (comm_per_layer).
"""
from __future__ import annotations

from npuspeed.plan.dims import Dims
from npuspeed.plan.graph import Op


def moe_mlp(g, d: Dims, m, x: str, out: str, opts, term: str = "moe") -> None:
    """`x` [t, h] (the pre-MLP norm's output) -> `out` [t, h]."""
    a = d.act
    t = d.tokens_sp
    experts, k = m.num_experts, m.moe_topk
    ep, etp = opts.moe_ep or 1, opts.moe_etp or 1  # PlanOptions (run.ResolvedRun.layer_options)
    local = max(experts // ep, 1)
    ffn = m.moe_ffn // etp
    glu = d.glu
    rows = t * k * (etp if d.tp > 1 else 1)  # expert-TP ranks gather their TP group's tokens
    h_rows = rows * d.hidden * a
    # router: logits, fp32 softmax (saved), top-k probabilities and routing map
    g.add(Op(f"{out}.router", (x,), {f"{out}.logits": t * experts * a}, saves=(x,),
             bwd_temp=experts * d.hidden * a, term=term))
    g.add(Op(f"{out}.topk", (f"{out}.logits",), {f"{out}.probs": t * experts * 4},
             saves=(f"{out}.scores",), extras={f"{out}.scores": t * experts * 4, f"{out}.map": t * experts},
             fwd_temp=2 * t * experts * 4, term=term))
    # permute: gathered rows, index kept for backward; probabilities follow the rows
    g.add(Op(f"{out}.permute", (x, f"{out}.probs"), {f"{out}.perm": h_rows, f"{out}.pprobs": rows * 4},
             saves=(f"{out}.idx",), extras={f"{out}.idx": rows * 8}, fwd_temp=t * experts * 4 + rows * 8,
             bwd_temp=t * d.hidden * a, term=term))
    y, probs = f"{out}.perm", f"{out}.pprobs"
    if ep > 1:
        g.add(Op(f"{out}.a2a", (y, probs), {f"{out}.disp": h_rows, f"{out}.dprobs": rows * 4}))
        y, probs = f"{out}.disp", f"{out}.dprobs"
    if local > 1:
        g.add(Op(f"{out}.sort", (y, probs), {f"{out}.sorted": h_rows, f"{out}.sprobs": rows * 4}))
        y, probs = f"{out}.sorted", f"{out}.sprobs"
    fc1_b = rows * ffn * glu * a
    act_b = rows * ffn * a
    w1 = d.hidden * ffn * glu * a
    w2 = ffn * d.hidden * a
    g.add(Op(f"{out}.fc1", (y,), {f"{out}.h1": fc1_b}, saves=(y,), bwd_temp=local * w1, term=term))
    if opts.moe_grouped and m.swiglu:
        # npuspeed's weighted SwiGLU: one op, saves its input and the probabilities
        g.add(Op(f"{out}.act", (f"{out}.h1", probs), {f"{out}.a": act_b}, saves=(f"{out}.h1", probs),
                 fwd_temp=rows * ffn * 4, bwd_temp=fc1_b + rows * ffn * 4, term=term))
    else:
        if m.swiglu:
            g.add(Op(f"{out}.glu", (f"{out}.h1",), {f"{out}.g": act_b}, saves=(f"{out}.h1", f"{out}.silu"),
                     extras={f"{out}.silu": act_b}, fwd_temp=act_b, term=term))
        else:
            g.add(Op(f"{out}.gelu", (f"{out}.h1",), {f"{out}.g": act_b}, saves=(f"{out}.h1",), term=term))
        # act * probs in fp32 (saves both factors), cast back to the activation dtype
        prod = rows * ffn * 4
        if a == 4:
            g.add(Op(f"{out}.scale", (f"{out}.g", probs), {f"{out}.a": prod}, saves=(f"{out}.g", probs), term=term))
        else:
            g.add(Op(f"{out}.scale", (f"{out}.g", probs), {f"{out}.p32": prod}, saves=(f"{out}.g", probs), term=term))
            g.add(Op(f"{out}.cast", (f"{out}.p32",), {f"{out}.a": act_b}))
    g.add(Op(f"{out}.fc2", (f"{out}.a",), {f"{out}.o": h_rows}, saves=(f"{out}.a",), fwd_temp=h_rows if local > 1 else 0,
             bwd_temp=local * w2, term=term))
    y = f"{out}.o"
    if local > 1:
        g.add(Op(f"{out}.unsort", (y,), {f"{out}.us": h_rows}))
        y = f"{out}.us"
    if ep > 1:
        g.add(Op(f"{out}.a2a_back", (y,), {f"{out}.comb": h_rows}))
        y = f"{out}.comb"
    g.add(Op(f"{out}.unpermute", (y,), {out: t * d.hidden * a}, fwd_temp=t * d.hidden * a, term=term))


def comm_per_layer(d: Dims, m, ep: int) -> dict:
    """Dispatch and combine all-to-alls, forward and backward: 4 x (EP-1)/EP of t k h bytes."""
    if ep < 2:
        return {}
    rows = d.tokens_sp * m.moe_topk
    return {"ep": 4 * (ep - 1) / ep * rows * d.hidden * d.act}
