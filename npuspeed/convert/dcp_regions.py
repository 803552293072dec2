"""Read chosen regions of a Megatron dist_checkpointing (torch_dist) checkpoint, a few at a time.

Megatron stacks each kind of layer parameter over the layers in one stored tensor (key
`decoder.layers.mlp.linear_fc1.weight`, shape [layers, ...]; experts add an axis), and its own
load asks for every layer of a key at once. Going back to Hugging Face one layer at a time needs
one layer's slice of such a tensor: this asks torch.distributed.checkpoint for exactly that
region (offsets, sizes) and reads it into a tensor of that size, so host memory holds only
the regions of one batch of parameters.

Where each parameter lives (its stored key and the offsets of its prepended axes) is what
the model itself declares: its `sharded_state_dict()`, built on the meta device.
"""
from __future__ import annotations

import torch

Region = tuple[str, tuple[int, ...], torch.Tensor]  # (stored key, offsets, destination of the region's size)


def locations(model) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Parameter name -> (stored key, offsets of the prepended layer/expert axes) of a GPTModel
    (built on any device, meta included)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    found = {}
    for name, entry in model.sharded_state_dict().items():
        if isinstance(entry, ShardedTensorFactory):
            built = entry.build()
            entry = next(iter(built.values())) if isinstance(built, dict) else built[0]
        if isinstance(entry, ShardedTensor):
            found[name] = (entry.key, tuple(int(o) for o in entry.global_offset[:entry.prepend_axis_num]))
    return found


def _planner(regions: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]):
    from torch.distributed.checkpoint.planner import LoadPlanner

    class RegionPlanner(_RegionPlanner, LoadPlanner):
        pass

    return RegionPlanner(regions)


class _RegionPlanner:
    """A torch.distributed.checkpoint load planner that reads the requested regions only."""

    def __init__(self, regions: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]):
        self.regions = regions

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False, **_):
        self.metadata = metadata

    def create_local_plan(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        items = []
        for key, wanted in self.regions.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(off), sizes=dest.size()) for off, dest in wanted]
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks)
        return LoadPlan(items)

    def create_global_plan(self, plans):
        return plans

    def finish_plan(self, plan):
        return plan

    def load_bytes(self, read_item, value):
        raise AssertionError(f"{read_item.dest_index.fqn}: only tensors are read")

    def resolve_tensor(self, read_item):
        dest = self.regions[read_item.dest_index.fqn][read_item.dest_index.index][1]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item, tensor):
        pass  # resolve_tensor handed out a view of the destination: nothing to copy back


def read(path: str, regions: list[Region]) -> None:
    """Fill each region's destination tensor from checkpoint directory `path`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    by_key: dict[str, list] = {}
    for key, offsets, dest in regions:
        by_key.setdefault(key, []).append((offsets, dest))
    dcp.load({}, storage_reader=FileSystemReader(path), planner=_planner(by_key))
