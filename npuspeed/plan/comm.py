"""Bytes each rank sends per training step, per parallel dimension (ring algorithms).

- TP: per layer and micro-batch, forward and backward, two all-reduces of [s, b, h] (or,
  under SP, the all-gather + reduce-scatter pairs of the same volume) for attention and the
  MLP; plus the embedding's and the loss's small all-reduces. A ring all-reduce of B bytes
  sends 2 (n-1)/n B per rank; an all-gather or reduce-scatter (n-1)/n B.
- PP: each micro-batch's activation sent forward and its gradient back, per chunk boundary.
- DP: the fp32 gradient buffer all-reduced once a step (reduce-scatter + parameter
  all-gather with the distributed optimizer: the same volume).
- CP: the ring's K/V and dK/dV and Ulysses' all-to-alls (ops_cp.py) at the degrees the CP
  feature's plan effect states; EP: the MoE dispatch and combine all-to-alls (ops_moe.py);
  plus any PlanEffect.comm_per_layer a feature states.
"""
from __future__ import annotations

from npuspeed.plan import ops_cp, ops_moe
from npuspeed.plan.run import ResolvedRun


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def volume(run: ResolvedRun) -> dict:
    """{dimension: bytes sent per rank per step} for the busiest pipeline stage."""
    spec, effects, d, options = run.spec, run.effects, run.dims, run.options
    m, lay = spec.model, spec.layout
    mbs = spec.batch.num_microbatches(lay.dp)
    layers = m.num_layers // lay.pp
    act_full = d.tokens * d.hidden * d.act
    out = {"tp": 0.0, "pp": 0.0, "dp": 0.0, "cp": 0.0, "ep": 0.0}
    if lay.tp > 1:
        per_layer = 2 * 2 * 2 * _ring(lay.tp) * act_full  # 2 collectives, fwd+bwd, all-reduce = 2x
        out["tp"] = per_layer * layers * mbs
    if lay.pp > 1:
        out["pp"] = run.placement.sends_per_microbatch() * d.h() * mbs  # forward, gradient back; per chunk
    grads = max(sum(stage) for stage in run.buffers) * 4  # the busiest stage's fp32 gradient buffers
    if lay.dp > 1:
        out["dp"] = 2 * _ring(lay.dp) * grads
    if lay.dp * lay.cp > 1 and lay.cp > 1:  # gradients reduce over DP x CP
        out["dp"] = 2 * _ring(lay.dp * lay.cp) * grads
    # EP: Megatron's all-to-all dispatcher; CP (and anything a feature changes): the plan effect
    per_layer_comm = {}
    if m.num_experts:
        per_layer_comm.update(ops_moe.comm_per_layer(d, m, run.experts.ep))
    if lay.cp > 1 and options.cp_ring is not None:
        per_layer_comm.update(ops_cp.comm_per_layer(d, options.cp_ulysses, options.cp_ring))
    per_layer_comm.update(effects.comm_per_layer)
    for dim, per_layer in per_layer_comm.items():
        out[dim] = per_layer * layers * mbs
    return out
