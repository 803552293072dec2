"""Predicted step time: the FLOPs and bytes of a step priced by a calibration profile.

The profile (`npuspeed plan --calibrate`, calibrate.py) holds what this machine achieved at
the model's own shapes: GEMM rates by size (forward + both backward products), attention
time per b x heads x s x s x d element for each kernel, element-wise time per activation
byte, per-op framework overhead, AdamW time per parameter, and the collective's latency
and bandwidth. A rank's step is its micro-batches' compute (forward + backward of its
layers, the embedding and the loss), stretched by the pipeline bubble, plus the
communication no feature hides, plus the optimizer step. Ranks that share cores (more ranks
than cores, as on a CPU host) divide them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from npuspeed.plan.dims import dims
from npuspeed.plan.params import chunk_params
from npuspeed.plan.spec import RunSpec

#: op kind -> the kernels the calibration times (a feature's PlanEffect.kernels names these)
KERNELS = {
    "attention": ("unfused", "flash", "sdpa_math"),
    "norm": ("torch", "fused"),
    "glu": ("unfused", "fused"),
    "rope": ("unfused", "fused"),
}

#: autograd ops per transformer layer, forward + backward (the framework's per-op cost)
OPS_PER_LAYER = 70


@dataclass
class StepTime:
    step_ms: float
    tokens_per_s: float
    compute_ms: float
    bubble_ms: float
    comm_ms: dict
    optimizer_ms: float
    flops_per_step: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def load_profile(path: str) -> dict:
    with open(path) as fh:
        profile = json.load(fh)
    if "gemm" not in profile or "version" not in profile:
        raise ValueError(f"{path} is not an `npuspeed plan --calibrate` profile")
    return profile


def _dtype(spec: RunSpec) -> str:
    return "fp32" if spec.batch.dtype == "fp32" else "bf16"


def gemm_seconds(profile: dict, dtype: str, m: int, k: int, n: int) -> float:
    """Forward + backward of [m, k] x [k, n]: 3 products, at the rate measured nearest in size."""
    flops = 6.0 * m * k * n
    table = profile["gemm"].get(dtype) or profile["gemm"]["fp32"]
    for row in table:
        if tuple(row[:3]) == (m, k, n):
            return flops / row[4]
    pts = sorted((float(row[3]), float(row[4])) for row in table)
    lf = math.log(flops)
    if lf <= math.log(pts[0][0]):
        rate = pts[0][1]
    elif lf >= math.log(pts[-1][0]):
        rate = pts[-1][1]
    else:
        for (f0, r0), (f1, r1) in zip(pts, pts[1:]):
            if math.log(f0) <= lf <= math.log(f1):
                t = (lf - math.log(f0)) / (math.log(f1) - math.log(f0))
                rate = r0 + t * (r1 - r0)
                break
    return flops / rate


def layer_flops(spec: RunSpec) -> float:
    d = dims(spec)
    qkv = (d.heads + 2 * d.groups) * d.head_dim
    mm = d.tokens * d.hidden * (qkv + d.heads * d.head_dim + d.ffn * d.glu + d.ffn)
    attn = 2 * d.batch * d.heads * d.seq * d.seq * d.head_dim
    return 6.0 * mm + 3.0 * attn


def _layer_seconds(spec: RunSpec, effects, profile: dict) -> float:
    d = dims(spec)
    dt = _dtype(spec)
    qkv = (d.heads + 2 * d.groups) * d.head_dim
    t = gemm_seconds(profile, dt, d.tokens, d.hidden, qkv)
    t += gemm_seconds(profile, dt, d.tokens, d.heads * d.head_dim, d.hidden)
    t += gemm_seconds(profile, dt, d.tokens, d.hidden, d.ffn * d.glu)
    t += gemm_seconds(profile, dt, d.tokens, d.ffn, d.hidden)
    kernel = effects.kernels.get("attention", "unfused") if effects else "unfused"
    if spec.model.recompute_granularity == "selective" and kernel == "unfused":
        kernel_factor = 4.0 / 3.0  # the S x S forward runs twice
    else:
        kernel_factor = 1.0
    attn = profile["attention"].get(dt, profile["attention"]["fp32"])
    per = attn.get(kernel, attn["unfused"])
    t += kernel_factor * per * d.batch * d.heads * d.seq * d.seq * d.head_dim
    # element-wise work: norms, dropouts, adds, activation: bytes of [tokens, h] and [tokens, ffn]
    ew = profile["elementwise_s_per_byte"].get(dt, profile["elementwise_s_per_byte"]["fp32"])
    t += ew * (12 * d.tokens_sp * d.hidden + 4 * d.tokens * d.ffn * d.glu) * d.act
    t += OPS_PER_LAYER * profile["op_overhead_s"]
    if spec.model.recompute_granularity == "full":
        t *= 4.0 / 3.0  # the forward runs again in backward
    return t


def _head_seconds(spec: RunSpec, profile: dict) -> float:
    d = dims(spec)
    dt = _dtype(spec)
    t = gemm_seconds(profile, dt, d.tokens, d.hidden, d.vocab)
    ew = profile["elementwise_s_per_byte"].get(dt, profile["elementwise_s_per_byte"]["fp32"])
    return t + ew * 6 * d.tokens * d.vocab * 4 + 30 * profile["op_overhead_s"]


def _collective_seconds(profile: dict, nbytes: float, calls: int) -> float:
    c = profile["collective"]
    return calls * c["latency_s"] + nbytes / c["bytes_per_s"]


def step_time(spec: RunSpec, effects, profile: dict, volume: dict) -> StepTime:
    lay = spec.layout
    d = dims(spec)
    mbs = spec.batch.num_microbatches(lay.dp)
    layers_per_rank = spec.model.num_layers // lay.pp
    per_mb = layers_per_rank * _layer_seconds(spec, effects, profile)
    per_mb_last = per_mb + _head_seconds(spec, profile)
    compute = mbs * per_mb_last
    if lay.pp > 1:
        stage = per_mb_last / lay.chunks
        bubble = (lay.pp - 1) * stage
    else:
        bubble = 0.0
    overlap = getattr(effects, "overlap", {}) if effects else {}
    comm = {}
    calls = {"tp": 8 * layers_per_rank * mbs + 6 * mbs, "pp": 2 * lay.chunks * mbs, "dp": 2 * lay.chunks,
             "cp": 4 * layers_per_rank * mbs, "ep": 4 * layers_per_rank * mbs}
    for dim, nbytes in volume.items():
        if nbytes:
            comm[dim] = _collective_seconds(profile, nbytes, calls[dim]) * (1.0 - overlap.get(dim, 0.0))
    params = max(sum(chunk_params(spec, r, c).total for c in range(lay.chunks)) for r in range(lay.pp))
    owned = params / lay.dp if lay.distributed_optimizer else params
    optimizer = owned * profile["adam_s_per_param"] + params * profile.get("grad_pass_s_per_param", 0.0)
    total = compute + bubble + sum(comm.values()) + optimizer + profile.get("step_overhead_s", 0.0)
    # ranks sharing a host's cores share them (a CPU host runs every rank on the same cores)
    per_node = min(lay.world, spec.extra.get("nproc_per_node") or lay.world)
    threads = profile.get("threads", 1)
    share = max(1.0, per_node * threads / max(profile.get("cores", per_node * threads), 1))
    total *= share
    tokens = spec.batch.global_size(lay.dp) * spec.model.seq_length
    flops = (layer_flops(spec) * spec.model.num_layers + 6.0 * d.tokens * d.hidden * d.vocab) * mbs * lay.dp * lay.tp
    return StepTime(step_ms=total * 1e3, tokens_per_s=tokens / total, compute_ms=compute * share * 1e3,
                    bubble_ms=bubble * share * 1e3, comm_ms={k: v * share * 1e3 for k, v in comm.items()},
                    optimizer_ms=optimizer * share * 1e3, flops_per_step=flops)
