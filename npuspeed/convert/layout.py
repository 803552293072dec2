"""A full (TP=1, one-stage) tensor cut into one rank's shard of a TP/PP/EP layout, and shards
put back together.

Megatron names a parameter by its chunk-local layer and expert numbers and holds 1/TP of it.
The layout-independent initialisation of the example and the checkpoint converter both work
on the *global* tensor (global layer, global expert, whole matrix), so both need the same two
rules: which global name a local parameter has, and which slice of the global tensor a rank
holds. SwiGLU's fused fc1 is the one tensor whose shard is not a contiguous slice: each rank
holds [gate_r; up_r], the r-th part of the gate rows followed by the r-th part of the up rows.
"""
from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")
_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")


def global_name(name: str, chunk, num_local_experts: int, ep_rank: int) -> str:
    """The TP=1/PP=1/EP=1 name of parameter `name` of model chunk `chunk` (a GPTModel)."""
    match = _LAYER.match(name)
    if match:
        layer = chunk.decoder.layers[int(match.group(2))]
        name = f"{match.group(1)}{layer.layer_number - 1}{match.group(3)}"
    match = _EXPERT.match(name)
    if match:
        name = f"{match.group(1)}{ep_rank * num_local_experts + int(match.group(2))}{match.group(3)}"
    if name == "output_layer.weight" and chunk.share_embeddings_and_output_weights:
        name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied weight
    return name


def is_swiglu_fc1(name: str, swiglu: bool, dim: int) -> bool:
    return swiglu and ".linear_fc1." in name and dim == 0


def shard(full: torch.Tensor, param, name: str, swiglu: bool, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's part of global tensor `full` for `param` (its Megatron attributes say how)."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1 or full.shape == param.shape:
        return full
    return shard_dim(full, param.partition_dim, is_swiglu_fc1(name, swiglu, param.partition_dim),
                     tp_rank, tp_size)


def shard_dim(full: torch.Tensor, dim: int, swiglu_fc1: bool, rank: int, size: int) -> torch.Tensor:
    """Rank `rank` of `size`'s part of `full` along `dim` ([gate_r; up_r] for SwiGLU's fc1)."""
    if swiglu_fc1:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], dim=0)
    return full.chunk(size, dim=dim)[rank]


def gather_dim(shards: list[torch.Tensor], dim: int, swiglu_fc1: bool) -> torch.Tensor:
    """The global tensor from every rank's part, in rank order: the inverse of `shard_dim`."""
    if len(shards) == 1:
        return shards[0]
    if swiglu_fc1:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def full_shape(param, tp_size: int) -> list[int]:
    """The global shape of `param`, a tensor-parallel shard of `tp_size`."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return shape


def padded_vocab_size(vocab: int, divisible_by: int, tp_size: int) -> int:
    """Megatron-LM's rule: the vocabulary rounded up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp_size
    return ((vocab + multiple - 1) // multiple) * multiple
