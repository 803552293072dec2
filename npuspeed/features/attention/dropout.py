"""Where the CPU kernels' dropout randomness comes from: Megatron's model-parallel RNG tracker.

Megatron draws attention dropout inside `get_cuda_rng_tracker().fork()` (or inside the
transformer block's fork under sequence parallelism). On the CPU backend that fork swaps the
tracker's state into the generator every draw goes to (npuspeed/features/device/rng.py and
accelerator/device_rng.py), so `draw_seed_offset` run inside it consumes the tracked state:
each call (layer, micro-batch, iteration) gets a fresh (seed, offset), tensor-parallel ranks
differ exactly as Megatron's own dropout does (their tracker seeds differ by rank), and a
checkpoint resume, which restores the tracker, draws the same masks again. The kernels then
regenerate each mask in backward from (seed, offset) instead of storing it.
"""
from __future__ import annotations

import torch

_LIMIT = 2**62


def draw_seed_offset() -> tuple[int, int]:
    """Two 62-bit integers from the generator in force (the forked tracker state)."""
    seed, offset = torch.randint(0, _LIMIT, (2,), dtype=torch.int64).tolist()
    return int(seed), int(offset)


def global_head0(module) -> int:
    """Global index of this rank's first attention head (tensor parallelism splits heads)."""
    try:
        from megatron.core import parallel_state

        rank = parallel_state.get_tensor_model_parallel_rank()
    except Exception:  # model parallelism not initialised (a bare module in a test)
        rank = 0
    return int(rank) * int(module.num_attention_heads_per_partition)
