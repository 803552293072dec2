"""Save and resume through megatron.core's dist_checkpointing.

Layout as Megatron-LM: `<dir>/iter_0000006/` plus `latest_checkpointed_iteration.txt`.
Each rank's RNG states (python, numpy, host torch, device, model-parallel tracker) are a
ShardedObject keyed by global rank, so a resume in the same layout continues bit for bit.
"""
from __future__ import annotations

import os
import random

import numpy as np
import torch
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from npuspeed import get_accelerator

_TRACKER = "latest_checkpointed_iteration.txt"


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _unwrap(chunk):
    """The GPTModel inside Megatron's DDP / Float16Module wrappers (checkpoints hold its keys)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _model_state(model) -> dict:
    if len(model) == 1:
        return {"model": _unwrap(model[0]).sharded_state_dict()}
    return {f"model{i}": _unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def _rng_object(data=None) -> ShardedObject:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return ShardedObject("rng_state", data, (world,), (rank,), replica_id=0)


def _rng_state() -> dict:
    return {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "device": get_accelerator().get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    get_accelerator().set_rng_state(state["device"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded(model, optimizer, scheduler, iteration, *, loading: bool, with_optim: bool, with_rng: bool):
    state = _model_state(model)
    merged = {}
    for part in state.values():
        merged.update(part)
    if with_optim:
        # As Megatron-LM: the distributed optimizer's state is saved per DP rank (dp_reshardable);
        # its default needs flattened-range ShardedTensors that torch_dist no longer supports.
        metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
        state["optimizer"] = optimizer.sharded_state_dict(merged, is_loading=loading, metadata=metadata)
        state["scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_object(None if loading else _rng_state())
    state["iteration"] = iteration
    return state


def save(root: str, iteration: int, model, optimizer, scheduler) -> str:
    path = _iter_dir(root, iteration)
    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    state = _sharded(model, optimizer, scheduler, iteration, loading=False, with_optim=True, with_rng=True)
    dist_checkpointing.save(state, path)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, _TRACKER), "w") as f:
            f.write(str(iteration))
    torch.distributed.barrier()
    return path


def latest_iteration(root: str) -> int | None:
    tracker = os.path.join(root, _TRACKER)
    if not os.path.exists(tracker):
        return None
    with open(tracker) as f:
        return int(f.read().strip())


def load(root: str, model, optimizer, scheduler, *, load_optim: bool = True, load_rng: bool = True,
         step: int | None = None) -> int:
    """Restore checkpoint `step` (default: the latest) under `root`; return its iteration (0: none)."""
    iteration = step if step is not None else latest_iteration(root)
    if iteration is None:
        return 0
    template = _sharded(model, optimizer, scheduler, iteration, loading=True,
                        with_optim=load_optim, with_rng=load_rng)
    state = dist_checkpointing.load(template, _iter_dir(root, iteration))
    if len(model) == 1:
        _unwrap(model[0]).load_state_dict(state["model"])
    else:
        for i, chunk in enumerate(model):
            _unwrap(chunk).load_state_dict(state[f"model{i}"])
    if load_optim:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    if load_rng:
        _set_rng_state(state["rng_state"])
    return int(state["iteration"])
