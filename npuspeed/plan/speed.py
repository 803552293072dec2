"""Predicted step time from a calibration profile of this model's real modules (calibrate.py).

The profile holds, per parallel group shape (TP, SP, CP, EP), the forward and backward time
of one Megatron TransformerLayer, of the embedding and of the output layer with the loss,
measured inside a real group of ranks (so TP/CP/EP collectives, the waits for the other
rank and the framework's Python per module are in them), at two token counts: a fixed part
per call and a part per token, with the attention kernel's quadratic part priced apart. A
plan whose attention kernel or recompute differs from the calibrated one is priced by the
difference (kernel times alone; the recomputed forward). A step is then: every pipeline
rank's micro-batches in Megatron's order (1F1B / interleaved, simulated with the
point-to-point hop between stages: the bubble follows), Megatron's finalize_model_grads
(the DP all-reduce or reduce-scatter), and the optimizer step, both fitted per parameter
between a one-layer chunk and one of the run's depth (up to 4 layers), so a plan interpolates.
Each calibrated figure is read at its fastest repeat (profile `estimate`, default "fastest");
"median" reads the median repeats the profile also keeps. A step sums many calls at their
typical time, so the fastest repeat is low by each call's spread (most where a call waits on
its peers: TP/CP/EP collectives on ranks sharing cores), but on a shared host a median taken
during a burst of other work keeps the burst (up to +94% on a loaded host here), so it is not
the default. On a quiet host both are within 25% of the step they stand for (the fastest step,
the median step) in 34 of 35 configurations (README, "Planning a run").
Fused norm/SwiGLU/RoPE kernels are priced as the calibrated ones (no per-kernel table).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from npuspeed.plan import schedule
from npuspeed.plan.dims import Dims
from npuspeed.plan.run import ResolvedRun
from npuspeed.plan.spec import RunSpec
from npuspeed.throughput import FlopsModel, model_flops, tflops_per_rank


@dataclass
class StepTime:
    step_ms: float
    tokens_per_s: float
    compute_ms: float
    bubble_ms: float
    comm_ms: dict
    optimizer_ms: float
    flops_per_step: float
    #: forward and backward of one layer, one micro-batch (ms), and the group shape priced
    layer_ms: tuple = (0.0, 0.0)
    group: str = ""
    notes: tuple = ()
    #: Megatron-LM's model FLOPs of the step (global batch) over the step time and the ranks
    tflops_per_s_per_rank: float = 0.0
    #: what --swap-optimizer's host copies add to the step (estimate, not calibrated)
    swap_ms: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def load_profile(path: str) -> dict:
    with open(path) as fh:
        profile = json.load(fh)
    if profile.get("version") != 2 or "groups" not in profile:
        raise ValueError(f"{path} is not an `npuspeed plan --calibrate` profile of this version (2): calibrate again")
    return profile


ESTIMATES = ("fastest", "median")


def _pick(table: dict, key: str, profile: dict):
    """`table[key]` at the profile's estimate: `key + "_median"` where measured and asked for."""
    estimate = profile.get("estimate", "fastest")
    if estimate not in ESTIMATES:
        raise ValueError(f"profile estimate {estimate!r}: one of {ESTIMATES}")
    return table.get(key + "_median", table[key]) if estimate == "median" else table[key]


def _dt(spec: RunSpec) -> str:
    return "fp32" if spec.batch.dtype == "fp32" else "bf16"


def _attention_s(profile, spec, d: Dims, kernel: str, b: int, s: int) -> float:
    table = profile["attention"].get(_dt(spec)) or next(iter(profile["attention"].values()))
    return table.get(kernel, table["unfused"]) * b * d.heads * s * s * d.head_dim


def _fit(points, values, extra) -> tuple[float, float]:
    """(fixed s, s per token) through the measured points, `extra(b, s)` taken out first."""
    ts = [b * s for b, s in points]
    vs = [v - extra(b, s) for (b, s), v in zip(points, values)]
    if len(ts) >= 2 and ts[0] != ts[1]:
        per = (vs[0] - vs[1]) / (ts[0] - ts[1])
        fixed = vs[0] - per * ts[0]
        if per > 0 and fixed >= 0:
            return fixed, per
    return 0.0, max(vs[0], 0.0) / ts[0]


class GroupTimes:
    """Forward/backward seconds of a layer, the embedding and the head at one (b, s) for a
    group shape of the profile."""

    def __init__(self, profile: dict, spec: RunSpec, d: Dims, key: str, kernel0: str):
        g = profile["groups"][key]
        self.points = [tuple(p) for p in g["tokens"]]
        cp = spec.layout.cp
        attn = (lambda share: (lambda b, s: share * _attention_s(profile, spec, d, kernel0, b, s))) if cp == 1 else (
            lambda share: (lambda b, s: 0.0))
        self.fits = {}
        for part in ("layer", "pre", "full"):
            for i, name in enumerate(("f", "b")):
                values = [row[i] for row in _pick(g, part, profile)]
                share = (1 / 3 if name == "f" else 2 / 3) if part == "layer" else 0.0
                self.fits[(part, name)] = _fit(self.points, values, attn(share))
        self.attn = attn

    def at(self, part: str, which: str, b: int, s: int) -> float:
        fixed, per = self.fits[(part, which)]
        share = (1 / 3 if which == "f" else 2 / 3) if part == "layer" else 0.0
        return fixed + per * b * s + self.attn(share)(b, s)


def _recompute_extra(spec: RunSpec, kernel: str, layer_f: float, attn_f: float) -> float:
    """Backward seconds a layer spends redoing forward work (Megatron's recompute)."""
    m = spec.model
    if m.recompute_granularity == "full":
        return layer_f
    if m.recompute_granularity == "selective" and kernel != "flash":
        return attn_f
    return 0.0


def group_key(tp: int, sp: bool, cp: int = 1, ep: int = 1) -> str:
    """The profile's name of a parallel group shape (calibrate.py times one per shape)."""
    return f"tp{tp}{'-sp' if sp else ''}-cp{cp}-ep{ep}"


def layer_seconds(profile: dict, run: ResolvedRun) -> tuple[float, float, float, float, float, float, str, list]:
    """(layer f, layer b, embedding f, embedding b, head f, head b) at this run's micro-batch."""
    spec, effects, d = run.spec, run.effects, run.dims
    lay, m = spec.layout, spec.model
    notes = []
    key = group_key(lay.tp, lay.sp, lay.cp, lay.ep)
    scale = 1.0
    if key not in profile["groups"]:
        fallback = group_key(1, False, 1, lay.ep) if group_key(1, False, 1, lay.ep) in profile["groups"] else next(
            iter(profile["groups"]))
        notes.append(f"group {key} not calibrated: priced from {fallback} / (TP x CP) (calibrate with these flags)")
        key, scale = fallback, 1.0 / (lay.tp * lay.cp)
    kernel0 = profile.get("variants", {}).get("core_attention", "unfused")
    kernel = effects.variants.get("core_attention", "unfused")
    g = GroupTimes(profile, spec, d, key, kernel0)
    # the profile's points are (micro-batch, whole sequence), a CP group's ranks holding S/CP of it
    # each (calib_worker.time_group): the fits are read at the run's whole sequence
    b, s, seq = spec.batch.micro_batch, m.seq_length // lay.cp, m.seq_length
    lf, lb = g.at("layer", "f", b, seq) * scale, g.at("layer", "b", b, seq) * scale
    pre_f, pre_b = g.at("pre", "f", b, seq) * scale, g.at("pre", "b", b, seq) * scale
    full_f, full_b = g.at("full", "f", b, seq) * scale, g.at("full", "b", b, seq) * scale
    emb = (max(pre_f - lf, 0.0), max(pre_b - lb, 0.0))
    head = (max(full_f - pre_f, 0.0), max(full_b - pre_b, 0.0))
    if lay.cp == 1 and kernel != kernel0:
        d_attn = _attention_s(profile, spec, d, kernel, b, s) - _attention_s(profile, spec, d, kernel0, b, s)
        lf, lb = lf + d_attn / 3, lb + 2 * d_attn / 3
        notes.append(f"attention kernel {kernel} priced against the calibrated {kernel0} by the kernels alone")
    # recompute: the calibrated layer already holds its own; add the difference
    attn_f = _attention_s(profile, spec, d, kernel, b, s) / 3
    calibrated = replace(spec, model=replace(m, recompute_granularity=profile.get("recompute_granularity")))
    extra = _recompute_extra(spec, kernel, lf, attn_f) - _recompute_extra(calibrated, kernel, lf, attn_f)
    if m.recompute_granularity == "full" and m.recompute_method == "block" and m.recompute_num_layers:
        extra *= min(m.recompute_num_layers, spec.layers_per_chunk()) / max(spec.layers_per_chunk(), 1)
    lb += extra
    # the features' recompute of the activation and the norms
    ew = profile["elementwise_s_per_byte"].get(_dt(spec)) or next(iter(profile["elementwise_s_per_byte"].values()))
    act = ew * 2 * d.tokens * d.ffn * d.glu * d.act  # the activation's forward again
    # the share of a chunk's layers that recompute it (all, or the first N), against the
    # calibrated layer's (calibrate.py times the variant on every layer it builds)
    n = max(spec.layers_per_chunk(), 1)
    planned = len(effects.layers_for("mlp_activation", n)) / n
    was = profile.get("variants", {}).get("mlp_activation", "keep") != "keep"
    lb += act * (planned - int(was))
    # norm recompute: the two norms' forward again (read x, write the output, each)
    norm = ew * 2 * 2 * d.h()
    planned = len(effects.layers_for("norm_output", n)) / n
    was = profile.get("variants", {}).get("norm_output", "keep") != "keep"
    lb += norm * (planned - int(was))
    return lf, lb, emb[0], emb[1], head[0], head[1], key, notes


def _line(points, nbytes: float) -> float:
    """Seconds for `nbytes` through two measured [bytes, seconds] points (latency + bandwidth)."""
    (n0, t0), (n1, t1) = points[0], points[-1]
    per = max((t1 - t0) / max(n1 - n0, 1), 0.0)
    return max(t0 - per * n0, 0.0) + per * nbytes


def _per_param(points, params: float, col: int) -> float:
    """Fixed + per-parameter fit through [params, grad bytes, finalize s, step s] rows."""
    (p0, *r0), (p1, *r1) = points[0], points[-1]
    t0, t1 = r0[col], r1[col]
    per = max((t1 - t0) / max(p1 - p0, 1), 0.0)
    return max(t0 - per * p0, 0.0) + per * params


def layer_flops(d: Dims) -> float:
    qkv = (d.heads + 2 * d.groups) * d.head_dim
    mm = d.tokens * d.hidden * (qkv + d.heads * d.head_dim + d.ffn * d.glu + d.ffn)
    attn = 2 * d.batch * d.heads * d.seq * d.seq * d.head_dim
    return 6.0 * mm + 3.0 * attn


def megatron_model_flops(spec: RunSpec) -> float:
    """Megatron-LM's count of one step's model FLOPs (npuspeed.throughput), the global batch's."""
    m, lay = spec.model, spec.layout
    shape = FlopsModel(num_layers=m.num_layers, hidden=m.hidden, ffn=m.ffn, heads=m.heads,
                       query_groups=m.query_groups, kv_channels=m.kv_channels, seq_length=m.seq_length,
                       padded_vocab=m.padded_vocab(lay.tp), swiglu=m.swiglu, num_experts=m.num_experts,
                       moe_topk=m.moe_topk, moe_ffn=m.moe_ffn or None)
    return model_flops(shape, spec.batch.global_size(lay.dp))


def swap_seconds(run: ResolvedRun, optimizer_s: float) -> float:
    """--swap-optimizer's cost: its bytes over the host link (PlanEffect.swap_optimizer), in and
    out at once; on a device hidden behind the update but for the first chunk in and the last
    out, on CPU (a memcpy each way in the same memory) not hidden."""
    sw = run.effects.swap_optimizer
    if not sw:
        return 0.0
    moved = 0
    for st in run.step_static:
        moved = max(moved, st.optimizer + (st.masters if sw.get("masters") else 0))
    bw = float(sw["link_bytes_per_s"])
    if not sw.get("overlapped"):
        return 2 * moved / bw
    chunk = min(sw.get("window_bytes", 0) / 3, moved)
    return max(0.0, moved / bw - optimizer_s) + 2 * chunk / bw


def step_time(run: ResolvedRun, profile: dict) -> StepTime:
    spec, d = run.spec, run.dims
    lay = spec.layout
    mbs = spec.batch.num_microbatches(lay.dp)
    lf, lb, ef, eb, hf, hb, key, notes = layer_seconds(profile, run)
    key = key if key in profile["groups"] else next(iter(profile["groups"]))
    n = spec.layers_per_chunk()
    g = profile["groups"][key]  # Megatron's schedule, per micro-batch and chunk:
    sched = _pick(g, "schedule", profile) if "schedule" in g else 0.0
    where = run.placement
    fwd = [[sched + n * lf + (ef if where.first(r, c) else 0.0) + (hf if where.last(r, c) else 0.0)
            for c in range(lay.chunks)] for r in range(lay.pp)]
    bwd = [[n * lb + (eb if where.first(r, c) else 0.0) + (hb if where.last(r, c) else 0.0)
            for c in range(lay.chunks)] for r in range(lay.pp)]
    coll = profile["collective"]
    hop = _line(coll["p2p"], d.h()) if lay.pp > 1 and coll.get("p2p") else 0.0
    busiest = max(sum(f + b for f, b in zip(fr, br)) * mbs for fr, br in zip(fwd, bwd))
    # finalize_model_grads and the optimizer step, on the rank with the most parameters
    params = max(sum(cp.total for cp in stage) for stage in run.stages)
    opt = profile["optimizer"]["distributed" if lay.distributed_optimizer and lay.dp * lay.cp > 1 else "plain"]
    pts = _pick(opt, "points", profile)
    dp_group = lay.dp * lay.cp
    finalize = _per_param(pts, params, 1)
    comm = {}
    if dp_group > 1:
        world = profile.get("world", 2)
        ring = (dp_group - 1) / dp_group / max((world - 1) / world, 1e-9)
        comm["dp"] = finalize * ring
    else:  # no data-parallel reduction: what finalize does besides it (measured with one, so a bound)
        comm["dp"] = 0.0
    hops = hop * run.placement.sends_per_microbatch() * mbs
    if lay.pp > 1:
        comm["pp"] = hops
        if spec.model.tied_embeddings:
            comm["pp"] += _line(coll["all_reduce"], d.vocab * spec.model.hidden * 4)
    optimizer = _per_param(pts, params, 2)
    swap = swap_seconds(run, optimizer)
    optimizer += swap
    model_flops_step = megatron_model_flops(spec)
    pipeline = schedule.simulate(lay.pp, lay.chunks, mbs, fwd, bwd, hop, where.schedule)
    total = pipeline + comm["dp"] + (comm.get("pp", 0.0) - hops if lay.pp > 1 else 0.0) + optimizer
    tokens = spec.batch.global_size(lay.dp) * spec.model.seq_length
    flops = (layer_flops(d) * spec.model.num_layers + 6.0 * d.tokens * d.hidden * d.vocab) * mbs * lay.dp * lay.tp \
        * lay.cp
    return StepTime(step_ms=total * 1e3, tokens_per_s=tokens / total, compute_ms=busiest * 1e3,
                    bubble_ms=max(pipeline - busiest, 0.0) * 1e3, comm_ms={k: v * 1e3 for k, v in comm.items()},
                    optimizer_ms=optimizer * 1e3, flops_per_step=flops, layer_ms=(lf * 1e3, lb * 1e3), group=key,
                    notes=tuple(notes), tflops_per_s_per_rank=tflops_per_rank(
                        model_flops_step, total * 1e3, lay.tp * lay.pp * lay.cp * lay.dp),
                    swap_ms=swap * 1e3)
