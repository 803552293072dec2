"""Predicted memory per rank: static bytes, each chunk's micro-batch replayed (graph.py), the
micro-batches the pipeline schedule holds at once (schedule.py), and the optimizer step.

The peak a rank reaches is the larger of: static bytes (with the optimizer states, which
exist from the first step on) plus the largest point of the forward/backward walk, and the
static bytes of the optimizer step (full fp32 masters, whatever reuse-fp32-param keeps
between steps) plus the step's own transient. Persistent buffers Megatron keeps across
micro-batches (the "mpu" global buffer: the unfused attention's score input and the
sequence-parallel all-gather, the cached causal mask) are counted once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from npuspeed.plan import ops, schedule
from npuspeed.plan.graph import replay
from npuspeed.plan.run import ResolvedRun


@dataclass
class RankMemory:
    pp_rank: int
    params: int
    grads: int
    masters: int
    optimizer: int
    buffers: int
    #: saved activation bytes of one micro-batch per chunk, and per layer (largest chunk)
    activation_per_microbatch: list
    activation_per_layer: int
    in_flight: int  # micro-batch chunks held at once at the peak of the walk
    activation_peak: int  # activations + transients at the walk's peak
    step_peak: int  # the optimizer step's peak
    peak: int
    activation_terms: dict = field(default_factory=dict)
    #: bytes --swap-optimizer keeps in host memory instead of on the device between steps
    #: (0 when off, and on the CPU backend, where the host is the device)
    swapped_optimizer: int = 0
    #: --swap-attention: bytes one micro-batch's chunk swaps to the host (largest chunk), and
    #: its largest layer's share
    swapped_per_microbatch: int = 0
    swapped_per_layer: int = 0

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def persistent_buffers(run: ResolvedRun) -> int:
    spec, effects, d = run.spec, run.effects, run.dims
    mpu = d.h(d.tokens) if d.sp else 0
    core = effects.variants.get("core_attention", "unfused")
    if core in ("unfused", "recompute") or spec.model.recompute_granularity == "selective" and core not in (
            "flash", "cp"):
        mpu = max(mpu, d.scores * d.act)
    mask = d.seq * d.seq if core not in ("flash", "cp") else 0
    rope = d.seq * d.head_dim * 4 if spec.model.position_embedding == "rope" else 0
    return mpu + mask + rope


def swap_optimizer(static, step_static, effects) -> tuple[int, int]:
    """--swap-optimizer: take the states (and masters where swapped) out of the static bytes
    between steps and of the step's own; (bytes off the device, the window the step holds).
    Where the host is the device nothing leaves it, and the chunks in flight come on top."""
    sw = effects.swap_optimizer
    if not sw:
        return 0, 0
    swapped = static.optimizer + (static.masters if sw.get("masters") else 0)
    step_swapped = step_static.optimizer + (step_static.masters if sw.get("masters") else 0)
    window = min(int(sw.get("window_bytes", 0)), step_swapped)
    if not sw.get("frees"):  # the host is the device: the host copies stay, the chunks in flight add
        return 0, window
    static.optimizer = step_static.optimizer = 0
    if sw.get("masters"):
        static.masters = step_static.masters = 0
    return swapped, window


def _events(run: ResolvedRun, pp_rank: int) -> list:
    """The rank's forwards and backwards in order (DualPipeV's under its V placement, a paired
    step's halves both alive when they take turns: PlanEffect.fb_pairs); at PP 1 a feature that
    keeps more micro-batches alive (PlanEffect.extra_in_flight: --moe-fb-overlap runs i's
    backward beside i+1's forward) runs that many more forwards before the first backward."""
    lay = run.spec.layout
    m = run.spec.batch.num_microbatches(lay.dp)
    if run.placement.v:
        return schedule.events(lay.pp, pp_rank, lay.chunks, m, run.placement.schedule,
                               taking_turns=run.effects.fb_pairs is not None)
    extra = min(run.effects.extra_in_flight, max(m - 1, 0)) if lay.pp == 1 else 0
    if not extra:
        return schedule.events(lay.pp, pp_rank, lay.chunks, m)
    return [("F", 0)] * extra + [ev for _ in range(m - extra) for ev in (("F", 0), ("B", 0))] + [("B", 0)] * extra


def rank_memory(run: ResolvedRun, pp_rank: int) -> RankMemory:
    spec, effects, d = run.spec, run.effects, run.dims
    lay = spec.layout
    static, step_static = run.stage_static(pp_rank), run.stage_static(pp_rank, step=True)
    buffers = persistent_buffers(run)
    swapped, window = swap_optimizer(static, step_static, effects)
    replays = []
    terms: dict = {}
    for chunk in range(lay.chunks):
        last = run.placement.last(pp_rank, chunk)
        r = replay(ops.chunk_ops(run, pp_rank, chunk), output_grad=0 if last else d.h())
        replays.append(r)
        for k, v in r.by_term.items():
            terms[k] = max(terms.get(k, 0), v)
    held = top = count = top_count = 0
    for kind, chunk in _events(run, pp_rank):
        r = replays[chunk]
        if kind == "F":
            if held + r.fwd_peak > top:
                top, top_count = held + r.fwd_peak, count + 1
            held += r.held
            count += 1
        else:
            if held + r.bwd_peak > top:
                top, top_count = held + r.bwd_peak, count
            held -= r.held
            count -= 1
    base = static.total + buffers
    step_peak = step_static.total + buffers + static.step_temp + window
    per_layer = 0
    n = spec.layers_per_chunk()
    if n:
        layer_terms = {k: v for k, v in terms.items() if k not in ("embedding", "head")}
        per_layer = sum(layer_terms.values()) // n
    return RankMemory(
        pp_rank=pp_rank, params=static.params, grads=static.grads, masters=static.masters,
        optimizer=static.optimizer, buffers=buffers,
        activation_per_microbatch=[r.held for r in replays], activation_per_layer=per_layer,
        in_flight=top_count, activation_peak=top, step_peak=step_peak,
        peak=max(base + top, step_peak), activation_terms=terms, swapped_optimizer=swapped,
        swapped_per_microbatch=max((sum(r.swapped.values()) for r in replays), default=0),
        swapped_per_layer=max((v for r in replays for v in r.swapped.values()), default=0),
    )


def predict(run: ResolvedRun) -> list[RankMemory]:
    """One RankMemory per pipeline stage (TP/CP/DP peers of a stage hold the same)."""
    return [rank_memory(run, r) for r in range(run.spec.layout.pp)]
