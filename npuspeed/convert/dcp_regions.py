"""Read chosen regions of a Megatron dist_checkpointing (torch_dist) checkpoint, a few at a time.

Megatron stacks each kind of layer parameter over the layers in one stored tensor (key
`decoder.layers.mlp.linear_fc1.weight`, shape [layers, ...]; experts add an axis), and its own
load asks for every layer of a key at once. Going back to Hugging Face one layer at a time needs
one layer's slice of such a tensor: this reads exactly that region (offsets, sizes) from the
stored chunks that overlap it (the checkpoint's metadata says which, in which file, at which
offset) straight into a tensor of that size, so host memory holds only that region.

Where each parameter lives (its stored key and the offsets of its prepended axes) is what
the model itself declares: its `sharded_state_dict()`, built on the meta device.
"""
from __future__ import annotations

import math
import os
import struct

import torch

from npuspeed.convert import raw_io

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


#: torch.save's names of typed storages (in a record's pickle) -> their element types
_STORAGE_DTYPES = {"FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
                   "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
                   "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
                   "BoolStorage": torch.bool}


class _Record:
    """One tensor torch.distributed.checkpoint stored with torch.save (a zip archive of a pickle
    and the storage's bytes, uncompressed) at [offset, offset + length) of a file: where its
    bytes are and how the tensor lies on them, read from the archive's directory and pickle
    without loading the tensor."""

    def __init__(self, path: str, offset: int, length: int):
        import pickle
        import zipfile

        with open(path, "rb") as f:
            archive = zipfile.ZipFile(_Window(f, offset, length))
            names = archive.namelist()
            pkl = [n for n in names if n.endswith("/data.pkl")]
            storages = [n for n in names if "/data/" in n]
            if len(pkl) != 1 or len(storages) != 1:
                raise ValueError(f"{path}@{offset}: not one tensor saved by torch.save ({names[:6]})")
            byteorder = [n for n in names if n.endswith("/byteorder")]
            if byteorder and archive.read(byteorder[0]) != b"little":
                raise ValueError(f"{path}@{offset}: a big-endian tensor")
            info = archive.getinfo(storages[0])
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"{path}@{offset}: a compressed tensor record")
            f.seek(offset + info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
            self.data = offset + info.header_offset + 30 + name_len + extra_len
            self.nbytes = info.file_size
            found = {}

            def rebuild(storage, storage_offset, size, stride, *rest):
                found.update(dtype=storage, offset=storage_offset, size=tuple(size), stride=tuple(stride))

            class Unpickler(pickle.Unpickler):
                def find_class(self, module, name):
                    if (module, name) in (("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor")):
                        return rebuild
                    if (module, name) == ("collections", "OrderedDict"):
                        return dict
                    if module == "torch" and name in _STORAGE_DTYPES:
                        return _STORAGE_DTYPES[name]
                    raise ValueError(f"{path}@{offset}: unexpected {module}.{name} in a tensor record")

                def persistent_load(self, pid):
                    return pid[1]  # ('storage', its dtype, key, location, numel)

            Unpickler(archive.open(pkl[0])).load()
        self.dtype, self.offset = found["dtype"], found["offset"]
        self.size, self.stride = found["size"], found["stride"]

    def contiguous(self) -> bool:
        expected = 1
        for n, s in zip(reversed(self.size), reversed(self.stride)):
            if n != 1 and s != expected:
                return False
            expected *= n
        return self.offset == 0


class _Window:
    """A file seen as its bytes [offset, offset + length) only (zipfile reads the archive there)."""

    def __init__(self, f, offset: int, length: int):
        self.f, self.start, self.length, self.pos = f, offset, length, 0

    def seek(self, pos, whence=0):
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self):
        return self.pos

    def seekable(self):
        return True

    def read(self, n=-1):
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        self.f.seek(self.start + self.pos)
        self.pos += n
        return self.f.read(n)


class Checkpoint:
    """A torch_dist checkpoint directory whose stored chunks are read straight into the regions
    asked for: no decoded copy of a chunk (torch's reader holds a chunk's decoded tensor and its
    destination at once)."""

    def __init__(self, path: str):
        from torch.distributed.checkpoint import FileSystemReader

        self.path = path
        self.metadata = FileSystemReader(path).read_metadata()

    def read(self, key: str, offsets: tuple[int, ...], dest: torch.Tensor) -> None:
        """Fill `dest` with the region of stored tensor `key` that starts at `offsets`."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        covered = 0
        for chunk in self.metadata.state_dict_metadata[key].chunks:
            lo = [max(c, o) for c, o in zip(chunk.offsets, offsets)]
            hi = [min(c + n, o + d) for c, n, o, d in zip(chunk.offsets, chunk.sizes, offsets, dest.shape)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            info = self.metadata.storage_data[MetadataIndex(key, chunk.offsets)]
            if getattr(info, "transform_descriptors", None):
                raise ValueError(f"{key}: stored with transforms {info.transform_descriptors}, which this reader "
                                 "does not undo")
            path = os.path.join(self.path, info.relative_path)
            record = _Record(path, info.offset, info.length)
            if record.size != tuple(chunk.sizes) or math.prod(record.size) * record.dtype.itemsize > record.nbytes:
                raise ValueError(f"{key}: a {record.size} record of {record.nbytes} bytes where the metadata says "
                                 f"{tuple(chunk.sizes)}")
            target = dest
            for dim, (a, b, o) in enumerate(zip(lo, hi, offsets)):
                target = target.narrow(dim, a - o, b - a)
            whole = all(a == c and b == c + n for a, b, c, n in zip(lo, hi, chunk.offsets, chunk.sizes))
            fd = os.open(path, os.O_RDONLY)
            try:
                if whole and record.contiguous() and record.dtype == dest.dtype:
                    raw_io.read_into(fd, record.data, target)  # straight into place
                else:  # part of a chunk, a strided chunk or another dtype: the chunk first
                    storage = torch.empty(record.nbytes // record.dtype.itemsize, dtype=record.dtype)
                    raw_io.read_into(fd, record.data, storage)
                    source = storage.as_strided(record.size, record.stride, record.offset)
                    for dim, (a, b, c) in enumerate(zip(lo, hi, chunk.offsets)):
                        source = source.narrow(dim, a - c, b - a)
                    target.copy_(source)
            finally:
                os.close(fd)
            covered += target.numel()
        if covered != dest.numel():
            raise ValueError(f"{key}: the checkpoint holds {covered} of the {dest.numel()} elements at {offsets}")


def read(path: str, regions: list[Region]) -> None:
    """Fill each region's destination tensor from checkpoint directory `path`."""
    checkpoint = Checkpoint(path)
    for key, offsets, dest in regions:
        checkpoint.read(key, offsets, dest)
