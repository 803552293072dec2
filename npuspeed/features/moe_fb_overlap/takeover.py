"""Megatron's own `--overlap-moe-expert-parallel-comm` (0.14+) runs npuspeed's overlap.

Megatron's combined 1F1B needs CUDA streams, Transformer Engine for its delayed weight
gradient, and a bf16/fp16 model. With npuspeed the flag asks for the same thing as
`--moe-fb-overlap`: the TransformerConfig built with it is checked with the field off (so its
bf16 and stream-specific assertions do not apply) and keeps it off, so Megatron's schedules take
their plain loop, which npuspeed's schedule pairs (schedule.py).
"""
from __future__ import annotations

import functools

RANGE = ">=0.14,<0.20"


def config_wrapper(note):
    def wrap(original):
        @functools.wraps(original)
        def __post_init__(self):
            if getattr(self, "overlap_moe_expert_parallel_comm", False):
                self.overlap_moe_expert_parallel_comm = False
                note("--overlap-moe-expert-parallel-comm: npuspeed's forward/backward overlap runs it "
                     "(Megatron's combined 1F1B needs CUDA streams and a bf16/fp16 model)")
            return original(self)

        return __post_init__

    return wrap
