"""The process groups of each algorithm, all built by Megatron's parallel_state.

Ring uses the context-parallel group as the ring; Ulysses uses it as the all-to-all group.
Hybrid needs both inside it: Megatron builds exactly those as its hierarchical context
parallel groups, `hierarchical_context_parallel_sizes = [U, R]` (level 0: U consecutive CP
ranks, the Ulysses group; level 1: R ranks strided by U, the ring), which the CP feature
passes to `initialize_model_parallel` (context_parallel/patches.py). Groups are created when every rank
initialises model parallelism, never lazily at the first attention call (a collective
`new_group` there would deadlock pipeline stages that are not in attention yet).
"""
from __future__ import annotations

import torch.distributed as dist

from npuspeed.features.base import FeatureError
from npuspeed.features.attention.comm import RingPeers
from npuspeed.features.attention.layout import CPLayout

_PEERS: dict = {}


def for_layout(cp: CPLayout):
    """(Ulysses group or None, ring group or None) of this rank."""
    if cp.size == 1:
        return None, None
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group()
    if dist.get_world_size(group) != cp.size:
        raise FeatureError(f"--context-parallel-size {cp.size}, but Megatron's context-parallel group has "
                           f"{dist.get_world_size(group)} ranks: pass the same size to initialize_model_parallel")
    if cp.algo == "megatron_cp_algo":
        return None, group
    if cp.algo == "ulysses_cp_algo":
        return group, None
    levels = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    if not levels or len(levels) != 2 or [dist.get_world_size(g) for g in levels] != [cp.ulysses, cp.ring]:
        raise FeatureError(
            f"--context-parallel-algo hybrid_cp_algo needs Megatron's hierarchical context-parallel "
            f"groups [{cp.ulysses}, {cp.ring}]; model parallelism was initialised without them "
            "(initialise it after `import npuspeed.megatron_adaptor`, or pass "
            f"hierarchical_context_parallel_sizes=[{cp.ulysses}, {cp.ring}])")
    return levels[0], levels[1]


def rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def peers(group) -> RingPeers | None:
    if group is None or dist.get_world_size(group) == 1:
        return None
    cached = _PEERS.get(id(group))
    if cached is None or cached[0] is not group:  # a group id may be reused after a re-initialisation
        cached = _PEERS[id(group)] = (group, RingPeers(group))
    return cached[1]
