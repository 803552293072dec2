"""Seconds a recompute or a swap adds to a layer, without a calibration profile.

The adaptive policy (adaptive.py) ranks candidates that differ only in what they redo or
copy. Counting FLOPs alone misorders them: Megatron's unfused core attention is a handful of
passes over a b x heads x S x S tensor (scores, mask, softmax, probabilities), memory-bound on
a CPU and on an accelerator alike, so its recompute costs far more than its FLOPs say (on this
CPU host 4 layers of selective recompute took as long as 3 layers of full recompute, where
FLOPs said under 2). So each recomputed op is priced as a roofline sum over the planner's own
op graph (ops.py): its matmul FLOPs at the backend's matmul rate, the bytes it reads and
writes at the backend's memory rate, and a fixed cost per op call.

The rates are nominal per backend (RATES), not timed at start-up: every rank plans the policy
on its own before any process group exists, and a timing would differ between ranks (two TP
peers with different recompute would mismatch their collectives); the ranking depends on the
rates' ratio only, and a `--profile` from `npuspeed plan --calibrate` still replaces them.
A swap's cost is its copies over the device's host link (the one figure per backend of
npuspeed/accelerator/host_link.py, asked of the device), hidden behind the layer's own forward
(device to host) and backward (host to device) time; where the host is the device (the
device's `host_is_device()`, CPU) a swap frees nothing and is never a candidate.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from npuspeed.plan import ops
from npuspeed.plan.dims import Dims
from npuspeed.plan.graph import Graph
from npuspeed.plan.run import ResolvedRun


@dataclass(frozen=True)
class Rates:
    """One backend's nominal speeds (per device, one rank)."""

    #: dense matmul FLOP/s by activation bytes (4: fp32, 2: bf16/fp16)
    matmul: dict
    #: bytes/s an elementwise or reduction pass moves (reads plus writes)
    memory: float
    #: seconds of framework and launch overhead per op call
    per_op: float


#: Nominal rates. cpu: one thread of this project's 2-core host at the example's shapes
#: (torch 2.13: [1024, 64] x [64, 768] matmul 52 GFLOP/s, fp32 softmax / masked_fill over
#: 8 x 512 x 512 at 9-12 GB/s, ~3.5 us per small op plus Megatron's module overhead);
#: cuda: an H100-class part at practical fractions of its datasheet (dense bf16 ~400 TFLOP/s,
#: TF32 ~200, HBM3 ~2.5 TB/s); npu: an Ascend 910B-class part (~250 TFLOP/s bf16, HBM
#: ~1.2 TB/s). Not measured here (no device). A backend without an entry is priced as cuda's.
RATES = {
    "cpu": Rates(matmul={4: 50e9, 2: 25e9}, memory=10e9, per_op=15e-6),
    "cuda": Rates(matmul={4: 200e12, 2: 400e12}, memory=2.5e12, per_op=10e-6),
    "npu": Rates(matmul={4: 100e12, 2: 250e12}, memory=1.2e12, per_op=15e-6),
}
DEFAULT_RATES = RATES["cuda"]


def rates_for(backend: str) -> Rates:
    return RATES.get(backend, DEFAULT_RATES)


def _bytes(sizes: dict, op) -> int:
    """Bytes an op reads (its inputs) and writes (its outputs and extras; an in-place view too)."""
    return sum(sizes.get(n, 0) for n in op.inputs) + sum(op.outputs.values()) + sum(op.extras.values())


def _layer_graph(run: ResolvedRun, variants: dict, options) -> Graph:
    d = run.dims
    g = Graph(inputs={"x": d.h()})
    ops.layer_ops(g, d, run.spec.model, "x", 0, variants, False, options, False)
    return g


def _matmul_flops(d: Dims, m, part: str, core: str) -> float:
    qkv = (d.heads + 2 * d.groups) * d.head_dim
    attn = 4.0 * d.batch * d.heads * d.seq * d.seq * d.head_dim  # Q K^T and P V
    if part == "core":
        return attn
    if part == "layer":
        if m.num_experts:
            width = (m.moe_ffn or m.ffn) * m.moe_topk // max(d.tp, 1)
            mlp = d.tokens * d.hidden * (width * d.glu + width)
        else:
            mlp = d.tokens * d.hidden * (d.ffn * d.glu + d.ffn)
        return 2.0 * (d.tokens * d.hidden * (qkv + d.heads * d.head_dim) + mlp) + attn
    return 0.0


def _kind(name: str) -> str:
    """Which recompute a layer graph's op belongs to: 'core', 'norm', 'act' or ''."""
    part = name.split(".", 2)[1] if name.count(".") >= 1 else ""
    if part == "ctx":
        return "core"
    if part in ("n1", "n2") and name.endswith(".norm"):
        return "norm"
    if part in ("act", "glu"):
        return "act"
    return ""


@dataclass(frozen=True)
class LayerCosts:
    """Seconds one layer and one micro-batch adds per recompute kind, and its own forward."""

    full: float
    core: float
    act: float
    norm: float
    forward: float
    backend: str
    #: the device's host link, bytes/s, and whether the host is the device (a swap frees nothing)
    host_link: float = 0.0
    host_is_device: bool = True


def layer_costs(run: ResolvedRun, device) -> LayerCosts:
    """`device`: the accelerator the run is planned for (its name, host_is_device() and
    host_link_bytes_per_s(); planner.PlannedDevice for another machine's)."""
    d, m, effects = run.dims, run.spec.model, run.effects
    backend = device.name
    r = rates_for(backend)
    variants = dict(effects.variants)
    core = variants.get("core_attention", "unfused")
    if core == "recompute":
        core = "unfused"
    variants["core_attention"] = core
    opts = run.options  # one layer's own cost: experts as stated, else all on this rank
    g = _layer_graph(run, variants, replace(opts, moe_ep=opts.moe_ep or 1, moe_etp=opts.moe_etp or 1))
    rate = r.matmul.get(d.act, r.matmul[2])
    sums = {"": [0, 0], "core": [0, 0], "norm": [0, 0], "act": [0, 0]}
    sizes = dict(g.inputs)
    for op in g.ops:
        sizes.update(op.outputs)
        sizes.update(op.extras)
    for op in g.ops:
        s = sums[_kind(op.name)]
        s[0] += _bytes(sizes, op)
        s[1] += 1

    def cost(kinds, flops) -> float:
        nbytes = sum(sums[k][0] for k in kinds)
        calls = sum(sums[k][1] for k in kinds)
        return flops / rate + nbytes / r.memory + calls * r.per_op

    full = cost(("", "core", "norm", "act"), _matmul_flops(d, m, "layer", core))
    # Megatron's selective recompute redoes the unfused core attention only (flash/CP keep theirs)
    selective = 0.0 if core in ("flash", "cp") else cost(("core",), _matmul_flops(d, m, "core", core)) + r.per_op
    on_host = device.host_is_device()
    return LayerCosts(full=full + r.per_op, core=selective, act=cost(("act",), 0.0) + 2 * r.per_op,
                      norm=cost(("norm",), 0.0) + 4 * r.per_op, forward=full, backend=backend,
                      host_link=0.0 if on_host else device.host_link_bytes_per_s(), host_is_device=on_host)


def swap_unavailable(costs: LayerCosts) -> str:
    """Why a swap is no candidate on the device of `costs` ("" where it is one)."""
    if costs.host_is_device:
        return f"not a candidate on the {costs.backend} backend: the host is the device, a swap frees nothing"
    return ""


def swap_stage_seconds(costs: LayerCosts, swapped_bytes: float, layers: int) -> float:
    """Exposed seconds a micro-batch of swapping `swapped_bytes` in each of `layers` layers, by
    the swap's own sizing rule (npuspeed/offload/sizing.py: the schedule the run's
    --swap-attention sizing replays with measured figures), here with the layer's roofline
    forward (backward twice it) and the host link this process knows (host_link.known: a
    measured or NPUSPEED_HOST_LINK_GBS figure) or the backend's nominal one; inf where the host
    is the device."""
    if costs.host_is_device or layers <= 0:
        return float("inf") if costs.host_is_device else 0.0
    from npuspeed.accelerator.host_link import LinkFigures, known
    from npuspeed.offload.sizing import LayerUnit, layers_wait

    link = known(costs.backend) or LinkFigures(costs.host_link, costs.host_link, True, "nominal")
    units = [LayerUnit(f"layer{i}", int(swapped_bytes), costs.forward, 2 * costs.forward) for i in range(layers)]
    return layers_wait(units, set(range(layers)), link) + 2 * layers * rates_for(costs.backend).per_op


def swap_seconds(costs: LayerCosts, swapped_bytes: float) -> float:
    """Exposed seconds of swapping `swapped_bytes` of one layer: the device-to-host copy hidden
    behind the next layer's forward, the host-to-device fetch behind the layer above's backward
    (about twice a forward); inf where the host is the device (nothing to gain)."""
    if costs.host_is_device:
        return float("inf")
    copy = swapped_bytes / costs.host_link
    return max(copy - costs.forward, 0.0) + max(copy - 2 * costs.forward, 0.0) + 2 * rates_for(costs.backend).per_op
