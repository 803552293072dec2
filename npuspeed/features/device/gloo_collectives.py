"""Uneven all-gather on gloo: megatron.core's MoE dispatcher gathers tokens across the expert
tensor-parallel ranks with a different row count per rank (`output_split_sizes`), through
`torch.distributed.all_gather` of a list, which ProcessGroupGloo refuses for unequal shapes
("invalid tensor size"). On gloo such a gather pads every rank's rows to the largest count,
gathers equal blocks, and keeps each rank's real rows: the same result, one collective."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

MAPPINGS = "megatron.core.tensor_parallel.mappings._gather_along_first_dim"


def uneven_gather_on_gloo(original):
    @functools.wraps(original)
    def _gather_along_first_dim(input_, group=None, output_split_sizes=None, use_global_buffer=False):
        # group=None as upstream has it: 0.12.0's _ScatterToSequenceParallelRegion.backward passes none
        sizes = None if output_split_sizes is None else [int(s) for s in output_split_sizes]
        if (sizes is None or len(set(sizes)) <= 1 or group is None or group.size() == 1
                or dist.get_backend(group) != "gloo"):
            return original(input_, group, output_split_sizes, use_global_buffer)
        rows = max(sizes)
        padded = input_.new_zeros((rows, *input_.shape[1:]))
        padded[:input_.shape[0]].copy_(input_)
        blocks = input_.new_empty((rows * group.size(), *input_.shape[1:]))
        dist.all_gather_into_tensor(blocks, padded, group=group)
        return torch.cat([block[:n] for block, n in zip(blocks.split(rows), sizes)])

    return _gather_along_first_dim


def register(registry, feature: str) -> None:
    registry.register(MAPPINGS, wrapper=uneven_gather_on_gloo, feature=feature, megatron=">=0.12,<0.20")
