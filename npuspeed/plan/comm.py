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

from npuspeed.plan.dims import dims
from npuspeed.plan.params import buffer_numel, chunk_params
from npuspeed.plan.spec import RunSpec


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def volume(spec: RunSpec, effects=None) -> dict:
    """{dimension: bytes sent per rank per step} for the busiest pipeline stage."""
    m, lay = spec.model, spec.layout
    d = dims(spec)
    mbs = spec.batch.num_microbatches(lay.dp)
    layers = m.num_layers // lay.pp
    act_full = d.tokens * d.hidden * d.act
    out = {"tp": 0.0, "pp": 0.0, "dp": 0.0, "cp": 0.0, "ep": 0.0}
    if lay.tp > 1:
        per_layer = 2 * 2 * 2 * _ring(lay.tp) * act_full  # 2 collectives, fwd+bwd, all-reduce = 2x
        out["tp"] = per_layer * layers * mbs
    if lay.pp > 1:
        boundaries = 2 * lay.chunks  # send forward, gradient back; per chunk
        out["pp"] = boundaries * d.h() * mbs
    if lay.dp > 1:
        grads = max(sum(buffer_numel(spec, chunk_params(spec, r, c)) for c in range(lay.chunks))
                    for r in range(lay.pp)) * 4
        out["dp"] = 2 * _ring(lay.dp) * grads
    if lay.dp * lay.cp > 1 and lay.cp > 1:  # gradients reduce over DP x CP
        grads = max(sum(buffer_numel(spec, chunk_params(spec, r, c)) for c in range(lay.chunks))
                    for r in range(lay.pp)) * 4
        out["dp"] = 2 * _ring(lay.dp * lay.cp) * grads
    # EP: Megatron's all-to-all dispatcher; CP (and anything a feature changes): the plan effect
    per_layer_comm = {}
    if m.num_experts:
        from npuspeed.plan import ops_moe
        from npuspeed.plan.spec import expert_layout

        per_layer_comm.update(ops_moe.comm_per_layer(d, m, expert_layout(spec, getattr(effects, "options", None))[0]))
    options = getattr(effects, "options", None) or {}
    if lay.cp > 1 and "cp_ring" in options:
        from npuspeed.plan import ops_cp

        per_layer_comm.update(ops_cp.comm_per_layer(d, options["cp_ulysses"], options["cp_ring"]))
    per_layer_comm.update(getattr(effects, "comm_per_layer", None) or {})
    for dim, per_layer in per_layer_comm.items():
        out[dim] = per_layer * layers * mbs
    return out
