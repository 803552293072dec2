"""What a run is, for the planner: the model, the parallel layout and the batch, as dataclasses.

Built from the same flags a training run takes (Megatron-LM's names, npuspeed/plan/flags.py).
Sizes are the ones Megatron-Core 0.16 builds: the vocabulary padded to a multiple of
`--make-vocab-size-divisible-by` x TP, kv_channels = hidden / heads unless given, the
expert FFN = the dense FFN unless given. Nothing here checks that a layout is possible;
`layout_problems` does, and lists every reason (the planner never crashes on one).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple


@dataclass(frozen=True)
class ModelSpec:
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    query_groups: int
    kv_channels: int
    seq_length: int
    vocab: int  # the tokenizer's size, before padding
    vocab_divisible_by: int = 128
    max_position_embeddings: int = 0
    normalization: str = "LayerNorm"
    swiglu: bool = False
    position_embedding: str = "learned_absolute"
    tied_embeddings: bool = True
    bias: bool = True
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    num_experts: int | None = None
    moe_topk: int = 2
    moe_ffn: int = 0
    #: Megatron's --recompute-granularity ("full" | "selective" | None), method and layer count
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None

    def padded_vocab(self, tp: int) -> int:
        multiple = self.vocab_divisible_by * tp
        return ((self.vocab + multiple - 1) // multiple) * multiple

    @property
    def glu(self) -> int:
        """fc1's output width per FFN unit: 2 for SwiGLU (gate and up), 1 otherwise."""
        return 2 if self.swiglu else 1


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # model chunks per pipeline rank (None: no interleaving)
    cp: int = 1
    ep: int = 1
    sp: bool = False
    world: int = 1
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False

    @property
    def dp(self) -> int:
        return max(self.world // max(self.tp * self.pp * self.cp, 1), 1)

    @property
    def dp_cp(self) -> int:
        """Ranks a gradient is reduced over and the distributed optimizer shards over (DP x CP)."""
        return self.dp * max(self.cp, 1)

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    def flags(self) -> list[str]:
        out = [f"--tensor-model-parallel-size {self.tp}", f"--pipeline-model-parallel-size {self.pp}"]
        if self.sp:
            out.append("--sequence-parallel")
        if self.cp > 1:
            out.append(f"--context-parallel-size {self.cp}")
        if self.ep > 1:
            out.append(f"--expert-model-parallel-size {self.ep}")
        if self.distributed_optimizer:
            out.append("--use-distributed-optimizer")
        if self.overlap_grad_reduce:
            out.append("--overlap-grad-reduce")
        return out


@dataclass(frozen=True)
class Batch:
    micro_batch: int = 1
    global_batch: int | None = None  # None: micro_batch x DP
    dtype: str = "fp32"  # "fp32" | "bf16" | "fp16"

    @property
    def act_bytes(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    def global_size(self, dp: int) -> int:
        return self.global_batch if self.global_batch is not None else self.micro_batch * dp

    def num_microbatches(self, dp: int) -> int:
        return max(self.global_size(dp) // max(self.micro_batch * dp, 1), 1)


@dataclass(frozen=True)
class RunSpec:
    model: ModelSpec
    layout: Layout
    batch: Batch
    #: npuspeed feature flags as given (argv form), for the feature effects and the flag line
    feature_argv: tuple[str, ...] = ()
    #: devices the world has (nproc-per-node x nnodes); the layout's world must not exceed it
    devices: int = 1
    device_memory_bytes: int | None = None
    extra: dict = field(default_factory=dict)
    #: the accelerator planned for ("cpu", "cuda", "npu"): what the features' plan effects ask
    #: of it (effects.collect sets it from the run's Context)
    device: str = "cpu"

    def with_layout(self, layout: Layout, feature_argv=None, micro_batch=None) -> "RunSpec":
        batch = self.batch if micro_batch is None else replace(self.batch, micro_batch=micro_batch)
        return replace(self, layout=layout, batch=batch,
                       feature_argv=self.feature_argv if feature_argv is None else tuple(feature_argv))

    def layers_per_chunk(self) -> int:
        return self.model.num_layers // (self.layout.pp * self.layout.chunks)


def layout_problems(spec: RunSpec, microbatches: bool = True) -> list[str]:
    """Every reason this layout cannot run (empty when it can), each naming the flag to change;
    with `microbatches`, also Megatron's schedules' needs of the micro-batch count (the planner
    asks microbatch_problems itself once the features have said which schedule runs)."""
    m, lay, b = spec.model, spec.layout, spec.batch
    out = list(spec.extra.get("problems", ()))
    for name, value in (("--tensor-model-parallel-size", lay.tp), ("--pipeline-model-parallel-size", lay.pp),
                        ("--context-parallel-size", lay.cp), ("--expert-model-parallel-size", lay.ep),
                        ("--micro-batch-size", b.micro_batch), ("--num-layers", m.num_layers),
                        ("--hidden-size", m.hidden), ("--num-attention-heads", m.heads),
                        ("--seq-length", m.seq_length)):
        if value < 1:
            out.append(f"{name} {value} must be >= 1")
    if out:
        return out
    ranks = lay.tp * lay.pp * lay.cp
    if lay.world > spec.devices:
        out.append(f"the layout needs {lay.world} ranks but the world has {spec.devices} devices "
                   "(--nproc-per-node x --nnodes)")
    if lay.world % ranks:
        out.append(f"world size {lay.world} is not divisible by TP x PP x CP = {ranks}")
    if m.heads % lay.tp:
        out.append(f"--num-attention-heads {m.heads} is not divisible by --tensor-model-parallel-size {lay.tp}")
    if m.query_groups % lay.tp:
        out.append(f"--num-query-groups {m.query_groups} is not divisible by --tensor-model-parallel-size {lay.tp}")
    if m.heads % m.query_groups:
        out.append(f"--num-attention-heads {m.heads} is not divisible by --num-query-groups {m.query_groups}")
    if m.ffn % lay.tp:
        out.append(f"--ffn-hidden-size {m.ffn} is not divisible by --tensor-model-parallel-size {lay.tp}")
    if m.num_layers % lay.pp:
        out.append(f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {lay.pp}")
    elif lay.vpp:
        per_stage = m.num_layers // lay.pp
        if lay.pp < 2:
            out.append("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        elif per_stage % lay.vpp:
            out.append(f"{per_stage} layers per pipeline stage do not split into {lay.vpp} virtual stages")
    if lay.sp and lay.tp < 2:
        out.append("--sequence-parallel needs --tensor-model-parallel-size > 1")
    seq_div = lay.tp if lay.sp else 1
    if m.seq_length % (seq_div * lay.cp * (2 if lay.cp > 1 else 1)):
        need = seq_div * lay.cp * (2 if lay.cp > 1 else 1)
        out.append(f"--seq-length {m.seq_length} is not divisible by {need} (sequence parallel TP x 2 x CP)")
    if m.num_experts:
        if m.num_experts % lay.ep:
            out.append(f"--num-experts {m.num_experts} is not divisible by --expert-model-parallel-size {lay.ep}")
        if lay.world % (lay.tp * lay.ep * lay.pp):
            out.append(f"world size {lay.world} is not divisible by TP x EP x PP = {lay.tp * lay.ep * lay.pp}")
        if not lay.sp and lay.tp > 1:  # Megatron-Core's MoELayer refuses to train so, with or without EP
            out.append("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (Megatron-Core)")
    elif lay.ep > 1:
        out.append(f"--expert-model-parallel-size {lay.ep} without --num-experts")
    if not out:
        dp = lay.dp
        gbs = b.global_size(dp)
        if gbs % (b.micro_batch * dp):
            out.append(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size x DP = "
                       f"{b.micro_batch * dp}")
        elif microbatches:
            out += microbatch_problems(spec)
    return out


def microbatch_problems(spec: RunSpec, schedule: str | None = None) -> list[str]:
    """What the pipeline schedule needs of the micro-batch count: Megatron's interleaved one a
    multiple of PP, DualPipeV (`schedule` "dualpipev") at least 2 x PP."""
    lay, b = spec.layout, spec.batch
    mbs = b.num_microbatches(lay.dp)
    if schedule == "dualpipev":
        if mbs < 2 * lay.pp:
            return [f"{mbs} micro-batches per step are fewer than 2 x --pipeline-model-parallel-size = {2 * lay.pp} "
                    "(DualPipeV needs at least 2 x PP): raise --global-batch-size"]
        return []
    if lay.vpp:
        if mbs < lay.pp:
            return [f"{mbs} micro-batches per step are fewer than --pipeline-model-parallel-size "
                    f"{lay.pp} (interleaved schedule needs at least PP)"]
        if mbs % lay.pp:
            return [f"{mbs} micro-batches are not a multiple of PP {lay.pp} (interleaved schedule)"]
    return []


def replace_layout(spec: RunSpec, **changes) -> RunSpec:
    """`spec` with some Layout fields changed (world kept unless given)."""
    return replace(spec, layout=replace(spec.layout, **changes))


class ExpertLayout(NamedTuple):
    ep: int
    etp: int
    edp: int

