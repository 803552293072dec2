"""One run resolved once: what memory, communication, speed and recompute cost all read.

`resolve(spec, effects)` turns the flags' RunSpec and the features' merged effects into one
immutable ResolvedRun: the per-rank tensor sizes (dims), the typed plan options, the expert
layout (EP, expert TP, expert DP: the features' options applied once) and every pipeline
stage's parameters and DDP buffers. The models below it read these fields instead of each
deriving them again from the spec and a loose options dict, so they cannot disagree.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from npuspeed.plan.dims import Dims, dims
from npuspeed.plan.params import ChunkParams, buffer_numel, chunk_params
from npuspeed.plan.spec import ExpertLayout, RunSpec, expert_layout
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

    @property
    def layer_options(self) -> PlanOptions:
        """The options the op graph of a layer reads: the expert layout filled in."""
        return replace(self.options, moe_ep=self.experts.ep, moe_etp=self.experts.etp)

    def stage_params(self, pp_rank: int) -> tuple[ChunkParams, ...]:
        return self.stages[pp_rank]


def resolve(spec: RunSpec, effects) -> ResolvedRun:
    options = PlanOptions.of(effects.options)
    experts = expert_layout(spec, options)
    lay = spec.layout
    stages = tuple(tuple(chunk_params(spec, r, c, experts, options.moe_grouped) for c in range(lay.chunks))
                   for r in range(lay.pp))
    buffers = tuple(tuple(buffer_numel(spec, cp, experts.edp) for cp in stage) for stage in stages)
    return ResolvedRun(spec=spec, effects=effects, dims=dims(spec), options=options, experts=experts,
                       stages=stages, buffers=buffers)
