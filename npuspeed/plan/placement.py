"""Which pipeline stage a (pipeline rank, model chunk) is, and so where the embedding (first
stage) and the output layer with the loss (last stage) sit: one answer for params.py, ops.py,
memory.py and speed.py.

Megatron's placement (1F1B and interleaved): chunk c of rank r is stage c x PP + r, so the
first stage is rank 0's chunk 0 and the last is rank PP-1's last chunk. DualPipeV's V (the
PlanEffect schedule "dualpipev"): P ranks hold 2P stages, chunk 0 of rank r is stage r and
chunk 1 is stage 2P-1-r, so rank 0 holds both the first and the last stage.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    pp: int
    chunks: int
    #: None: Megatron's placement; "dualpipev": the V (plan_vocabulary.SCHEDULES)
    schedule: str | None = None

    def __post_init__(self):
        if self.schedule == "dualpipev" and (self.pp < 2 or self.chunks != 2):
            raise ValueError(f"DualPipeV places 2 chunks on each of 2+ pipeline ranks (got PP {self.pp}, "
                             f"{self.chunks} chunks)")

    @property
    def v(self) -> bool:
        return self.schedule == "dualpipev"

    def stage(self, pp_rank: int, chunk: int) -> int:
        if self.v:
            return pp_rank if chunk == 0 else 2 * self.pp - 1 - pp_rank
        return chunk * self.pp + pp_rank

    def sends_per_microbatch(self) -> int:
        """Activations and gradients the busiest rank sends to another rank per micro-batch: one
        each way per chunk (Megatron's count); in the V the end ranks hand one chunk's output to
        the other chunk or the loss inside the rank, so at PP 2 every rank sends two."""
        if self.pp < 2:
            return 0
        return 2 if self.v and self.pp == 2 else 2 * self.chunks

    def first(self, pp_rank: int, chunk: int) -> bool:
        """Whether the chunk is the first stage (it holds the embedding)."""
        return self.stage(pp_rank, chunk) == 0

    def last(self, pp_rank: int, chunk: int) -> bool:
        """Whether the chunk is the last stage (it holds the final norm, the output layer, the loss)."""
        return self.stage(pp_rank, chunk) == self.pp * self.chunks - 1


def of(layout, schedule: str | None = None) -> Placement:
    """The placement of `layout` (spec.Layout) under the features' pipeline schedule."""
    return Placement(layout.pp, layout.chunks, schedule)
