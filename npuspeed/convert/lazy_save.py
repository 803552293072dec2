"""Save a dist_checkpointing checkpoint whose tensors are produced only when written.

`dist_checkpointing.save` takes the model's whole sharded state dict and Megatron's writer
stages every tensor before it writes one, so the whole model would sit in host memory. Here
the model exists on the meta device only (its sharded_state_dict says each tensor's key,
shape and offsets, and Megatron's own save does the rest: common state, metadata.json, the
ShardedObjects); the tensor writes go through a torch.distributed.checkpoint FileSystemWriter
whose `write_data` asks the planner for one item, writes it (torch.save, the record the reader
expects, at an offset of one file) and drops it before it asks for the next; the planner makes
each tensor then from the Hugging Face tensors (`materialize`). torch's own write_data keeps
the last tensor written of every stored key until the file is complete (the embedding to the
end) and the previous one while it makes the next (reading ahead where an accelerator is
present); here host memory holds one parameter.
"""
from __future__ import annotations

import inspect
import os
from typing import Callable

import torch

from npuspeed.convert import host_memory


def _writer(path: str):
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    class OneAtATimeWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            name = f"{plan.storage_data.prefix}0.distcp"
            results = []
            with open(os.path.join(self.path, name), "wb") as stream:
                for item in plan.items:
                    data = planner.resolve_data(item)
                    offset = stream.tell()
                    if item.type == WriteItemType.BYTE_IO:
                        stream.write(data.getbuffer())
                    else:
                        data = data.detach()
                        if data.untyped_storage().nbytes() != data.nbytes:  # a view: torch.save writes its storage
                            data = data.clone()
                        torch.save(data, stream)
                    del data
                    length = stream.tell() - offset
                    results.append(WriteResult(index=item.index, size_in_bytes=length,
                                               storage_data=_StorageInfo(name, offset, length)))
                stream.flush()
                os.fsync(stream.fileno())
            done = torch.futures.Future()
            done.set_result(results)
            return done

    return OneAtATimeWriter(path)


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
                host_memory.give_back()
                self.cache[name] = materialize(name)
            region = self.cache[name]
            for dim, (start, length) in enumerate(zip(offset[p:], sizes[p:])):
                region = region.narrow(dim, start, length)
            return region.reshape(sizes).contiguous()

    class LazySave(mcore_torch.TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            import torch.distributed.checkpoint as dcp

            state, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            pyt_state = mcore_torch.mcore_to_pyt_state_dict(state, False)
            params = inspect.signature(mcore_torch.MCoreSavePlanner.__init__).parameters
            kwargs = {k: v for k, v in dict(dedup_replicated_tensors=False, flatten_state_dict=False).items()
                      if k in params or "kwargs" in params}
            dcp.save(pyt_state, storage_writer=_writer(str(checkpoint_dir)),
                     planner=LazyPlanner(**kwargs))

    params = inspect.signature(mcore_torch.TorchDistSaveShardedStrategy.__init__).parameters
    args = ("torch_dist", 1) if "backend" in params else ()
    return LazySave(*args)


def save(state: dict, path: str, materialize: Callable[[str], torch.Tensor], where) -> None:
    """dist_checkpointing.save of `state` (its model on the meta device), each parameter's
    tensor from `materialize(parameter name)` as it is written."""
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(state, path, sharded_strategy=_strategy(materialize, where))
