"""Parameters per rank and what the optimizer keeps for them (Megatron-Core 0.16, no TE/apex).

Per model chunk, Megatron's DDP puts every parameter into one contiguous fp32 gradient
buffer (bf16 runs reduce in fp32); with the distributed optimizer the parameters move into a
buffer too, each starting at a multiple of 64 elements and each bucket padded to
lcm(DP, 128), and the shared embedding of a pipelined tied model gets its own bucket.
Mixed precision keeps an fp32 master per parameter (a shard of them with the distributed
optimizer), created with the optimizer; torch AdamW's exp_avg and exp_avg_sq are created at
the first step. Its single-tensor loop holds sqrt(v) and the new denominator while the
previous parameter's denominator is still referenced: three fp32 tensors of the largest
parameter (shard) at once, the optimizer step's own peak.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from npuspeed.plan.spec import RunSpec, ceil_div, lcm


@dataclass
class ChunkParams:
    """Parameter element counts of one model chunk on one rank, by where they sit."""

    layers: int = 0
    embedding: int = 0
    head: int = 0
    shared_embedding: int = 0  # the last stage's copy of a tied embedding (own bucket)
    sizes: list = field(default_factory=list)  # every tensor's element count (for padding and the step)

    @property
    def total(self) -> int:
        return self.layers + self.embedding + self.head + self.shared_embedding


def layer_param_sizes(spec: RunSpec) -> list[int]:
    m, tp = spec.model, spec.layout.tp
    h, hn = m.hidden, m.kv_channels
    np_, ng = m.heads // tp, max(m.query_groups // tp, 1)
    qkv = (np_ + 2 * ng) * hn
    ffn = m.ffn // tp
    norm = [h, h] if m.normalization == "LayerNorm" else [h]
    sizes = list(norm) + [h * qkv] + ([qkv] if m.bias else [])
    sizes += [np_ * hn * h] + ([h] if m.bias else [])
    sizes += list(norm) + [h * ffn * m.glu] + ([ffn * m.glu] if m.bias else [])
    sizes += [ffn * h] + ([h] if m.bias else [])
    return sizes


def chunk_params(spec: RunSpec, pp_rank: int, chunk: int) -> ChunkParams:
    m, lay = spec.model, spec.layout
    out = ChunkParams()
    per_layer = layer_param_sizes(spec)
    n_layers = spec.layers_per_chunk()
    out.sizes = per_layer * n_layers
    out.layers = sum(per_layer) * n_layers
    vocab = m.padded_vocab(lay.tp) // lay.tp
    first = pp_rank == 0 and chunk == 0
    last = pp_rank == lay.pp - 1 and chunk == lay.chunks - 1
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


def buffer_numel(spec: RunSpec, cp: ChunkParams) -> int:
    """Elements of the chunk's DDP buffer (padded as Megatron pads it under the distributed optimizer)."""
    if not spec.layout.distributed_optimizer:
        return cp.total
    dp = spec.layout.dp
    bucket = lcm(dp, 128)
    numel = 0
    for n in cp.sizes:
        numel = ceil_div(numel, 64) * 64 + n
    numel = ceil_div(numel, bucket) * bucket
    if cp.shared_embedding:
        numel += ceil_div(cp.shared_embedding, bucket) * bucket
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


def static_memory(spec: RunSpec, pp_rank: int, master_bytes: float | None = None) -> StaticMemory:
    """Static bytes on a rank of pipeline stage `pp_rank` (its model chunks together).

    `master_bytes`: bytes per parameter the fp32 master keeps between steps (None: 4, a full
    copy; --reuse-fp32-param states 2 through its plan effect)."""
    lay, batch = spec.layout, spec.batch
    p_bytes = 4 if batch.dtype == "fp32" else 2
    mixed = batch.dtype != "fp32"
    dp = lay.dp
    out = StaticMemory()
    largest = 0
    for chunk in range(lay.chunks):
        cp = chunk_params(spec, pp_rank, chunk)
        buf = buffer_numel(spec, cp)
        out.params += (buf if lay.distributed_optimizer else cp.total) * p_bytes
        out.grads += buf * 4
        owned = ceil_div(cp.total, dp) if lay.distributed_optimizer else cp.total
        if mixed:
            out.masters += int(owned * (4 if master_bytes is None else master_bytes))
        out.optimizer += owned * 8
        biggest = max(cp.sizes + [cp.shared_embedding])
        largest = max(largest, min(biggest, ceil_div(buf, dp)) if lay.distributed_optimizer else biggest)
    # AdamW's single-tensor loop: three fp32 tensors of the largest (shard of a) parameter
    out.step_temp = 3 * largest * 4
    return out
