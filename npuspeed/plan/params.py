"""Parameters per rank and what the optimizer keeps for them (Megatron-Core 0.16, no TE/apex).

Per model chunk, Megatron's DDP puts every parameter into one contiguous fp32 gradient
buffer (bf16 runs reduce in fp32); with the distributed optimizer the parameters move into a
buffer too, each starting at a multiple of 64 elements and each bucket padded to
lcm(DP, 128), and the shared embedding of a pipelined tied model gets its own bucket.
Mixed precision keeps an fp32 master per parameter (a shard of them with the distributed
optimizer), created with the optimizer; torch AdamW's exp_avg and exp_avg_sq are created at
the first step. npuspeed's device layer builds it with `fused=True` (features/device/fused_adam.py):
the kernel updates each tensor in place with no temporary of a parameter's size. Megatron's own
(`--npuspeed-adam megatron`), the single-tensor loop, holds sqrt(v) and the new denominator while
the previous parameter's denominator is still referenced: three fp32 tensors of the largest
parameter (shard) at once, the optimizer step's own peak.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from npuspeed.plan import placement as placement_mod
from npuspeed.plan.spec import ExpertLayout, RunSpec


def megatrons_adam(argv) -> bool:
    """`--npuspeed-adam megatron` among the run's flags (the optimizer as Megatron builds it)."""
    argv = list(argv)
    return "--npuspeed-adam=megatron" in argv or any(
        a == "--npuspeed-adam" and b == "megatron" for a, b in zip(argv, argv[1:]))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def lcm(*values: int) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


@dataclass
class ChunkParams:
    """Parameter element counts of one model chunk on one rank, by where they sit."""

    layers: int = 0
    embedding: int = 0
    head: int = 0
    shared_embedding: int = 0  # the last stage's copy of a tied embedding (own bucket)
    sizes: list = field(default_factory=list)  # every tensor's element count (for padding and the step)
    experts: int = 0  # this rank's expert weights (their own DDP buffer, expert-data-parallel)
    expert_sizes: list = field(default_factory=list)

    @property
    def dense(self) -> int:
        return self.layers + self.embedding + self.head + self.shared_embedding

    @property
    def total(self) -> int:
        return self.dense + self.experts


def layer_param_sizes(spec: RunSpec) -> list[int]:
    m, tp = spec.model, spec.layout.tp
    h, hn = m.hidden, m.kv_channels
    np_, ng = m.heads // tp, max(m.query_groups // tp, 1)
    qkv = (np_ + 2 * ng) * hn
    ffn = m.ffn // tp
    norm = [h, h] if m.normalization == "LayerNorm" else [h]
    sizes = list(norm) + [h * qkv] + ([qkv] if m.bias else [])
    sizes += [np_ * hn * h] + ([h] if m.bias else [])
    if m.num_experts:  # the MoE layer's router (replicated); its experts are expert_param_sizes
        return sizes + list(norm) + [m.num_experts * h]
    sizes += list(norm) + [h * ffn * m.glu] + ([ffn * m.glu] if m.bias else [])
    sizes += [ffn * h] + ([h] if m.bias else [])
    return sizes


def expert_param_sizes(spec: RunSpec, experts: ExpertLayout, grouped: bool = False) -> list[int]:
    """One MoE layer's expert weights on this rank: per local expert fc1 and fc2 (SequentialMLP),
    or two grouped weights of all local experts (GroupedMLP, --moe-grouped-gemm)."""
    m = spec.model
    if not m.num_experts:
        return []
    ep, etp, _ = experts
    local, ffn = m.num_experts // ep, m.moe_ffn // etp
    w1, w2 = m.hidden * ffn * m.glu, ffn * m.hidden
    if grouped:
        return [local * w1, local * w2]
    one = [w1] + ([ffn * m.glu] if m.bias else []) + [w2] + ([m.hidden] if m.bias else [])
    return one * local


def chunk_params(spec: RunSpec, pp_rank: int, chunk: int, experts: ExpertLayout, grouped: bool = False,
                 placement: placement_mod.Placement | None = None) -> ChunkParams:
    """`placement`: where the first and last stages sit (None: Megatron's, placement.py)."""
    m, lay = spec.model, spec.layout
    placement = placement or placement_mod.of(lay)
    out = ChunkParams()
    per_layer = layer_param_sizes(spec)
    n_layers = spec.layers_per_chunk()
    out.sizes = per_layer * n_layers
    out.layers = sum(per_layer) * n_layers
    out.expert_sizes = expert_param_sizes(spec, experts, grouped) * n_layers
    out.experts = sum(out.expert_sizes)
    vocab = m.padded_vocab(lay.tp) // lay.tp
    first, last = placement.first(pp_rank, chunk), placement.last(pp_rank, chunk)
    if first:
        emb = [vocab * m.hidden]
        if m.position_embedding == "learned_absolute":
            emb.append(m.max_position_embeddings * m.hidden)
        out.embedding = sum(emb)
        out.sizes += emb
    if last:
        norm = [m.hidden, m.hidden] if m.normalization == "LayerNorm" else [m.hidden]
        out.head = sum(norm)
        out.sizes += norm
        if not m.tied_embeddings:
            out.head += vocab * m.hidden
            out.sizes.append(vocab * m.hidden)
        elif lay.pp > 1:
            out.shared_embedding = vocab * m.hidden  # not in `sizes`: a bucket of its own
    return out


def _padded(sizes, dp: int) -> int:
    bucket = lcm(dp, 128)
    numel = 0
    for n in sizes:
        numel = ceil_div(numel, 64) * 64 + n
    return ceil_div(numel, bucket) * bucket


def buffer_numel(spec: RunSpec, cp: ChunkParams, expert_dp: int) -> int:
    """Elements of the chunk's DDP buffers (padded as Megatron pads them under the distributed
    optimizer): the dense one, the shared embedding's bucket, the experts' own (over expert DP)."""
    if not spec.layout.distributed_optimizer:
        return cp.total
    dp = spec.layout.dp_cp
    numel = _padded(cp.sizes, dp)
    if cp.shared_embedding:
        numel += _padded([cp.shared_embedding], dp)
    if cp.expert_sizes:
        numel += _padded(cp.expert_sizes, expert_dp)
    return numel


@dataclass
class StaticMemory:
    params: int = 0
    grads: int = 0
    masters: int = 0
    optimizer: int = 0
    #: the optimizer step's own transient above the static bytes
    step_temp: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.masters + self.optimizer


def static_memory(spec: RunSpec, edp: int, stage, buffers, master_bytes: float | None = None) -> StaticMemory:
    """Static bytes on a rank of one pipeline stage (its chunks' ChunkParams `stage` and DDP
    `buffers`), its model chunks together; `edp`: expert DP.

    `master_bytes`: bytes per parameter the fp32 master keeps between steps (None: 4, a full
    copy; --reuse-fp32-param states 2 through its plan effect)."""
    lay, batch = spec.layout, spec.batch
    p_bytes = 4 if batch.dtype == "fp32" else 2
    mixed = batch.dtype != "fp32"
    dp = lay.dp_cp
    out = StaticMemory()
    largest = 0
    for cp, buf in zip(stage, buffers):
        out.params += (buf if lay.distributed_optimizer else cp.total) * p_bytes
        out.grads += buf * 4
        owned = ceil_div(cp.dense, dp) + ceil_div(cp.experts, edp) if lay.distributed_optimizer else cp.total
        if mixed:
            out.masters += int(owned * (4 if master_bytes is None else master_bytes))
        out.optimizer += owned * 8
        biggest = max(cp.sizes + cp.expert_sizes + [cp.shared_embedding])
        largest = max(largest, min(biggest, ceil_div(buf, dp)) if lay.distributed_optimizer else biggest)
    # Megatron's AdamW (single-tensor loop): three fp32 tensors of the largest (shard of a) parameter;
    # torch's fused kernel (the device layer's default): none
    out.step_temp = 3 * largest * 4 if megatrons_adam(spec.feature_argv) else 0
    return out


def stages(spec: RunSpec, experts: ExpertLayout, grouped: bool, master_bytes: float | None,
           placement: placement_mod.Placement | None = None):
    """Per pipeline rank: its chunks' ChunkParams, their DDP buffer elements, and its static
    bytes with the features' fp32 masters (`master_bytes`) and at the optimizer step (full);
    `placement`: which chunks hold the embedding and the head (None: Megatron's)."""
    lay = spec.layout
    params = tuple(tuple(chunk_params(spec, r, c, experts, grouped, placement) for c in range(lay.chunks))
                   for r in range(lay.pp))
    buffers = tuple(tuple(buffer_numel(spec, cp, experts.edp) for cp in stage) for stage in params)
    static = tuple(static_memory(spec, experts.edp, s, b, master_bytes) for s, b in zip(params, buffers))
    step = tuple(static_memory(spec, experts.edp, s, b, None) for s, b in zip(params, buffers))
    return params, buffers, static, step
