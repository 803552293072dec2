"""One run resolved once: what memory, communication, speed and recompute cost all read.

`resolve(spec, effects)` turns the flags' RunSpec and the features' merged effects into one
immutable ResolvedRun: the per-rank tensor sizes (dims), the typed plan options, the expert
layout (EP, expert TP, expert DP: the features' options applied once), every pipeline
stage's parameters and DDP buffers, and its static bytes (params.py). The models below it
read these fields instead of each deriving them again from the spec and a loose options
dict, so they cannot disagree.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from npuspeed.plan.dims import Dims, dims
from npuspeed.plan import placement as placement_mod
from npuspeed.plan.params import ChunkParams, StaticMemory, stages
from npuspeed.plan.spec import ExpertLayout, RunSpec
from npuspeed.plan_vocabulary import PlanOptions


@dataclass(frozen=True)
class ResolvedRun:
    spec: RunSpec
    #: the enabled features' merged plan effects (npuspeed/plan/effects.py Effects)
    effects: object
    #: per-rank tensor sizes of one micro-batch
    dims: Dims
    #: the features' plan options, typed
    options: PlanOptions
    #: EP, expert TP and expert DP of a MoE run (Megatron's unless an option changes them)
    experts: ExpertLayout
    #: per pipeline stage, per model chunk: the parameters on one rank
    stages: tuple
    #: per pipeline stage, per model chunk: elements of the chunk's DDP buffers
    buffers: tuple
    #: per pipeline stage: static bytes between steps (the features' fp32 masters) and at the
    #: optimizer step (full masters); copy before changing one (dataclasses.replace)
    static: tuple = ()
    step_static: tuple = ()
    #: which (pipeline rank, chunk) is which stage: Megatron's, or the V of the features' schedule
    placement: placement_mod.Placement | None = None

    def __post_init__(self):
        if self.placement is None:  # Megatron's
            object.__setattr__(self, "placement", placement_mod.of(self.spec.layout))

    @property
    def layer_options(self) -> PlanOptions:
        """The options the op graph of a layer reads: the expert layout filled in."""
        return replace(self.options, moe_ep=self.experts.ep, moe_etp=self.experts.etp)

    def stage_params(self, pp_rank: int) -> tuple[ChunkParams, ...]:
        return self.stages[pp_rank]

    def stage_static(self, pp_rank: int, step: bool = False) -> StaticMemory:
        """A copy of stage `pp_rank`'s static bytes (at the optimizer step with `step`)."""
        return replace((self.step_static if step else self.static)[pp_rank])


def expert_layout(spec: RunSpec, options=None) -> ExpertLayout:
    """(EP, expert TP, expert DP) of a MoE run: Megatron's defaults (EP as given, expert TP =
    TP, expert DP = world / (PP x EP x expert TP)) unless a feature's plan options say otherwise
    (--moe-tp-extend-ep: EP x TP ranks, expert TP 1). Computed once per run (resolve)."""
    lay = spec.layout
    ep = int(options.moe_ep if options is not None and options.moe_ep is not None else lay.ep)
    etp = int(options.moe_etp if options is not None and options.moe_etp is not None else lay.tp)
    return ExpertLayout(ep, etp, max(lay.world // max(lay.pp * ep * etp, 1), 1))


def resolve(spec: RunSpec, effects) -> ResolvedRun:
    options = PlanOptions.of(effects.options)
    experts = expert_layout(spec, options)
    d = dims(spec)
    where = placement_mod.of(spec.layout, effects.schedule)
    params, buffers, static, step = stages(spec, experts, options.moe_grouped, effects.master_bytes, where)
    return ResolvedRun(spec=spec, effects=effects, dims=d, options=options, experts=experts,
                       stages=params, buffers=buffers, static=static, step_static=step, placement=where)
