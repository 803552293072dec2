"""Save a dist_checkpointing checkpoint whose tensors are produced only when written.

`dist_checkpointing.save` takes the model's whole sharded state dict and Megatron's writer
stages every tensor before it writes one, so the whole model would sit in host memory. Here
the model exists on the meta device only (its sharded_state_dict says each tensor's key,
shape and offsets, and Megatron's own save does the rest: common state, metadata.json, the
ShardedObjects); the tensor writes go through torch.distributed.checkpoint's plain
FileSystemWriter, which asks the planner for one tensor at a time, and the planner makes it
then from the Hugging Face tensors (`materialize`). Host memory holds a parameter or two.
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch


def _strategy(materialize: Callable[[str], torch.Tensor], where: dict[str, tuple[str, tuple[int, ...]]]):
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    owner = {}  # stored key -> {offsets of the prepended axes: parameter name}
    for name, (key, prefix) in where.items():
        owner.setdefault(key, {})[prefix] = name

    class LazyPlanner(mcore_torch.MCoreSavePlanner):
        cache: dict[str, torch.Tensor] = {}

        def resolve_data(self, write_item):
            if write_item.tensor_data is None:  # bytes: ShardedObjects, 0.19's common state
                return super().resolve_data(write_item)
            key, offset = write_item.index.fqn, tuple(write_item.index.offset)
            sizes = tuple(write_item.tensor_data.chunk.sizes)
            prefixes = owner[key]
            p = len(next(iter(prefixes)))
            name = prefixes[offset[:p]]
            if name not in self.cache:
                self.cache.clear()  # SwiGLU's fc1 is written as two chunks: keep the last parameter
                self.cache[name] = materialize(name)
            region = self.cache[name]
            for dim, (start, length) in enumerate(zip(offset[p:], sizes[p:])):
                region = region.narrow(dim, start, length)
            return region.reshape(sizes).contiguous()

    class LazySave(mcore_torch.TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import FileSystemWriter

            state, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            pyt_state = mcore_torch.mcore_to_pyt_state_dict(state, False)
            params = inspect.signature(mcore_torch.MCoreSavePlanner.__init__).parameters
            kwargs = {k: v for k, v in dict(dedup_replicated_tensors=False, flatten_state_dict=False).items()
                      if k in params or "kwargs" in params}
            dcp.save(pyt_state, storage_writer=FileSystemWriter(str(checkpoint_dir), thread_count=1),
                     planner=LazyPlanner(**kwargs))

    params = inspect.signature(mcore_torch.TorchDistSaveShardedStrategy.__init__).parameters
    args = ("torch_dist", 1) if "backend" in params else ()
    return LazySave(*args)


def save(state: dict, path: str, materialize: Callable[[str], torch.Tensor], where) -> None:
    """dist_checkpointing.save of `state` (its model on the meta device), each parameter's
    tensor from `materialize(parameter name)` as it is written."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(state, path, sharded_strategy=_strategy(materialize, where))
