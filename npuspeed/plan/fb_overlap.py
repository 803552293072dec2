"""The step with and without --moe-fb-overlap, at the planned device's rates.

Per MoE layer and micro-batch: the attention part's and the MLP part's forward from the
device's roofline over the planner's own op graph (matmul FLOPs at its matmul rate, the bytes
each op moves at its memory rate, a fixed cost per op: recompute_cost.RATES), backward twice
the forward; dispatch and combine each move the t x k x h activation rows of ops_moe, priced
over the node's links and the network (interconnect.py) for the EP group as the world lays it
out. Without the overlap a step is every micro-batch's compute plus all its all-to-alls. With
it, each of the m - 1 forward/backward pairs (PlanEffect.fb_pairs) hides, per layer, each
all-to-all only up to the compute beside it:
  combine backward  beside attention forward    dispatch forward beside MLP backward
  dispatch backward beside MLP forward          combine forward  beside attention backward
so the first forward's and the last backward's stay exposed. The optimizer step and the DP
gradient reduction are the same either way and not counted (the ratio is the forward/backward's).
"""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.plan import ops
from npuspeed.plan.graph import Graph
from npuspeed.plan.interconnect import all_to_all_seconds, links_for
from npuspeed.plan.recompute_cost import rates_for
from npuspeed.plan.run import ResolvedRun
from npuspeed.plan_vocabulary import SWAP_PARTS


@dataclass(frozen=True)
class FbOverlapStep:
    device: str
    links: str
    pairs: int
    #: one MoE layer, one micro-batch, seconds: attention and MLP forward, one all-to-all
    attention_f: float
    mlp_f: float
    a2a: float
    step_without_s: float
    step_with_s: float
    a2a_s: float  # all-to-all seconds per step without the overlap
    hidden_s: float

    @property
    def ratio(self) -> float:
        return self.step_without_s / self.step_with_s if self.step_with_s else 1.0

    @property
    def hidden_fraction(self) -> float:
        return self.hidden_s / self.a2a_s if self.a2a_s else 0.0

    def as_dict(self) -> dict:
        return {"device": self.device, "links": self.links, "forward_backward_pairs": self.pairs,
                "step_ms_without": self.step_without_s * 1e3, "step_ms_with": self.step_with_s * 1e3,
                "ratio": self.ratio, "a2a_ms": self.a2a_s * 1e3, "a2a_hidden_ms": self.hidden_s * 1e3,
                "a2a_hidden_fraction": self.hidden_fraction, "layer_attention_forward_ms": self.attention_f * 1e3,
                "layer_mlp_forward_ms": self.mlp_f * 1e3, "layer_a2a_ms": self.a2a * 1e3}


def pair_hidden(attention_f: float, mlp_f: float, dispatch: float, combine: float) -> float:
    """Seconds of one layer's all-to-alls hidden in one forward/backward pair (backward = 2 x forward)."""
    return (min(combine, attention_f) + min(dispatch, 2 * mlp_f) + min(dispatch, mlp_f)
            + min(combine, 2 * attention_f))


def _parts(run: ResolvedRun, backend: str) -> tuple[float, float, float]:
    """Forward seconds of one layer's attention part, its MLP part, and the head (roofline)."""
    d, m, r = run.dims, run.spec.model, rates_for(backend)
    variants = dict(run.effects.variants)
    if variants.get("core_attention") == "recompute":
        variants["core_attention"] = "unfused"
    g = Graph(inputs={"x": d.h()})
    ops.layer_ops(g, d, m, "x", 0, variants, False, run.layer_options, False)
    sizes = dict(g.inputs)
    for op in g.ops:
        sizes.update(op.outputs)
        sizes.update(op.extras)
    moved = {"attention": [0, 0], "mlp": [0, 0]}
    for op in g.ops:
        if op.name.endswith((".a2a", ".a2a_back")):
            continue  # communication: priced over the links
        part = "mlp" if op.name.split(".")[1] in SWAP_PARTS["mlp"] else "attention"
        moved[part][0] += sum(sizes.get(n, 0) for n in op.inputs) + sum(op.outputs.values()) + sum(op.extras.values())
        moved[part][1] += 1
    rate = r.matmul.get(d.act, r.matmul[2])
    qkv = (d.heads + 2 * d.groups) * d.head_dim
    attn_flops = 2.0 * d.tokens * d.hidden * (qkv + d.heads * d.head_dim) + 4.0 * d.batch * d.heads * d.seq ** 2 * d.head_dim
    width = m.moe_ffn * m.moe_topk // max(run.experts.etp, 1)
    mlp_flops = 2.0 * d.tokens * d.hidden * (width * d.glu + width + m.num_experts)
    attention, mlp = ((f / rate + b / r.memory + calls * r.per_op) for f, (b, calls) in
                      ((attn_flops, moved["attention"]), (mlp_flops, moved["mlp"])))
    head = 2.0 * d.tokens * d.hidden * d.vocab / rate + d.tokens * d.vocab * (d.act + 8) / r.memory
    return attention, mlp, head


def predict(run: ResolvedRun, backend: str) -> FbOverlapStep:
    """The step of the busiest pipeline stage with and without the pairing (`backend`: the
    planned device's name, whose rates and links price it); the pairs are the feature's
    (m - 1 at PP 1; at PP > 1 paired chunk steps of the first stage: features/moe_fb_overlap/plan.py),
    never more than the micro-batches allow."""
    spec, d = run.spec, run.dims
    lay = spec.layout
    mbs = spec.batch.num_microbatches(lay.dp)
    pairs = min(run.effects.fb_pairs or 0, max(mbs * lay.chunks - 1, 0))  # chunk steps (PP 1: micro-batches)
    layers = spec.layers_per_chunk() * lay.chunks
    attention_f, mlp_f, head_f = _parts(run, backend)
    links = links_for(backend)
    rows = d.tokens_sp * spec.model.moe_topk * (run.experts.etp if d.tp > 1 else 1)
    per_node = spec.extra.get("nproc_per_node") or lay.world
    a2a = all_to_all_seconds(links, rows * d.hidden * d.act, run.experts.ep, per_node)  # dispatch = combine
    compute = mbs * (layers * 3 * (attention_f + mlp_f) + 3 * head_f)
    a2a_total = mbs * layers * 4 * a2a
    hidden = pairs * spec.layers_per_chunk() * pair_hidden(attention_f, mlp_f, a2a, a2a)
    without = compute + a2a_total
    return FbOverlapStep(device=backend, links=f"{links.intra_name} / {links.inter_name}", pairs=pairs,
                         attention_f=attention_f, mlp_f=mlp_f, a2a=a2a, step_without_s=without,
                         step_with_s=without - hidden, a2a_s=a2a_total, hidden_s=hidden)

