"""The safetensors format, read and written one tensor at a time with plain file I/O.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, [begin, end) byte offsets into the data that follows; `__metadata__` optional) and the
tensors' bytes in row-major order. Reading a tensor here is one read straight into the
destination (which may be a view of a fused or padded parameter: raw_io.py); the library's
`safe_open` maps the whole file instead, and the touched pages count in the process's memory
until it is closed. Writing lays out the header from the tensors' shapes alone, so each tensor
is written when it exists and no shard is ever held in memory.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from npuspeed.convert import raw_io

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of the first byte, from the start of the file
    nbytes: int


def read_header(path: str) -> dict[str, Entry]:
    """name -> Entry of every tensor in the file; ValueError (a reason) when it is not sound."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise ValueError(f"its header claims {n} bytes, the file has {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ValueError(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    entries, start = {}, 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name}: header entry {info!r} is not a dtype, shape and data_offsets "
                             f"this reader knows ({', '.join(DTYPES)})") from None
        numel = math.prod(shape)
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise ValueError(f"tensor {name}: {shape} {info['dtype']} needs {numel * dtype.itemsize} bytes, "
                             f"its offsets span {end - begin}")
        if start + end > size:
            raise ValueError(f"tensor {name} ends at byte {start + end}, the file has {size} (truncated?)")
        entries[name] = Entry(dtype, shape, start + begin, end - begin)
    return entries


def read_into(path: str, entry: Entry, view: torch.Tensor) -> None:
    """Fill `view` (any strides, entry's element count) with the tensor's elements, in its dtype."""
    if view.numel() * entry.dtype.itemsize != entry.nbytes:
        raise ValueError(f"{view.numel()} elements asked for, the tensor has {entry.nbytes // entry.dtype.itemsize}")
    fd = os.open(path, os.O_RDONLY)
    try:
        raw_io.read_into(fd, entry.offset, view, entry.dtype)  # another precision: converted into place
    finally:
        os.close(fd)


class Writer:
    """One safetensors file whose tensors (names, dtypes, shapes, in this order) are written one
    at a time by `write`, in any order; the file is complete when all are written."""

    def __init__(self, path: str, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        at, layout = 0, []
        for name, dtype, shape in tensors:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [at, at + nbytes]}
            layout.append((name, dtype, tuple(shape), at, nbytes))
            at += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the library writes it
        start = 8 + len(text)
        self.entries = {name: Entry(dtype, shape, start + off, nbytes) for name, dtype, shape, off, nbytes in layout}
        self.left = set(self.entries)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        head = memoryview(struct.pack("<Q", len(text)) + text)
        while len(head):
            head = head[os.write(self.fd, head):]
        os.ftruncate(self.fd, start + at)

    def write(self, name: str, tensor: torch.Tensor) -> bool:
        """Write one tensor (any strides; any shape of the header's element count, whose row-major
        order is the stored one); True once the file is complete (and closed)."""
        entry = self.entries[name]
        if tensor.dtype != entry.dtype or tensor.numel() * tensor.dtype.itemsize != entry.nbytes:
            raise ValueError(f"{name}: a {tuple(tensor.shape)} {tensor.dtype} tensor where the header says "
                             f"{entry.shape} {entry.dtype}")
        self.left.remove(name)
        raw_io.write_from(self.fd, entry.offset, tensor)
        if not self.left:
            os.close(self.fd)
            self.fd = -1
        return not self.left

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
