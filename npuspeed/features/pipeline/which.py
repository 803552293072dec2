"""Which pipelined schedule the flags ask for, for every feature that needs to know.

`--moe-fb-overlap` (and Megatron's `--overlap-moe-expert-parallel-comm`) pairs each forward with a
backward; `--schedules-method dualpipev` runs DualPipeV's V. The two features own those flags,
and their `enabled` answers from here; the features that step aside for a schedule or drive it
(DualPipeV pairs with the overlap on, the overlap leaves the interleaved schedule to the V,
Megatron-LM's reporting rank moves under the V, the device feature's bubble baseline stays off)
ask here too, so that no feature imports another's folder. The names are the flags' argparse
destinations (the features' Config fields).
"""
from __future__ import annotations

import os


def pairs_overlap(args) -> bool:
    """Whether the forward/backward overlap's flag is on (it runs DualPipeV's pairs taking turns)."""
    return bool(getattr(args, "moe_fb_overlap", False) or getattr(args, "overlap_moe_expert_parallel_comm", False))


def v_schedule(args) -> bool:
    """Whether `--schedules-method dualpipev` is on (features whose patches step aside for it ask)."""
    return getattr(args, "schedules_method", None) == "dualpipev"


def microbatches_per_step(m) -> int | None:
    """Micro-batches a pipeline rank runs a step, from the command line and the launcher's
    WORLD_SIZE (None where they do not say): what the pipelined schedules need enough of."""
    world = int(os.environ.get("WORLD_SIZE", "0") or 0)
    gbs, mbs = getattr(m, "global_batch_size", None), getattr(m, "micro_batch_size", None) or 1
    tp, cp = getattr(m, "tensor_model_parallel_size", None) or 1, getattr(m, "context_parallel_size", None) or 1
    pp = getattr(m, "pipeline_model_parallel_size", None) or 1
    if not gbs or not world or world % (tp * pp * cp):
        return None
    return gbs // (mbs * (world // (tp * pp * cp)))
