"""Tensor bytes straight between a file range and a tensor (or a strided view of one).

Both checkpoint formats store a tensor as its bytes in row-major order at a known offset, so a
conversion reads a tensor straight into the memory it ends up in (a view of a fused or padded
parameter) and writes a view straight from the parameter it is part of: no decoded copy, no
staging buffer, no mmap'd file pages counted in the process's memory. A view that is not
contiguous is moved as its contiguous row blocks, in order.
"""
from __future__ import annotations

import itertools
import os

import torch


def blocks(view: torch.Tensor):
    """The contiguous pieces of `view`, in row-major order (one piece when it is contiguous)."""
    if view.numel() == 0:
        return
    # the trailing dims that are laid out contiguously: each index into the leading ones is a block
    lead, expected = view.dim(), 1
    while lead > 0 and (view.shape[lead - 1] == 1 or view.stride(lead - 1) == expected):
        expected *= view.shape[lead - 1]
        lead -= 1
    for index in itertools.product(*(range(n) for n in view.shape[:lead])):
        yield view[index] if index else view


def _bytes(block: torch.Tensor) -> memoryview:
    return memoryview(block.detach().reshape(-1).view(torch.uint8).numpy())


def _read_exact(fd: int, offset: int, buf: memoryview) -> int:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise EOFError(f"the file ends {offset + done} bytes in, inside a tensor")
        done += n
    return done


def read_into(fd: int, offset: int, view: torch.Tensor, stored: torch.dtype | None = None,
              buffer_bytes: int = 16 * 2**20) -> int:
    """Fill `view` from the file's elements at `offset` (row-major, of dtype `stored`, default
    the view's); return the bytes read. Another dtype is read through a buffer of at most
    `buffer_bytes` and converted into place, a piece at a time."""
    done = 0
    if stored is None or stored == view.dtype:
        for block in blocks(view):
            done += _read_exact(fd, offset + done, _bytes(block))
        return done
    step = max(1, buffer_bytes // stored.itemsize)
    buffer = torch.empty(min(step, view.numel()), dtype=stored)
    for block in blocks(view):
        flat = block.reshape(-1)
        for start in range(0, flat.numel(), step):
            piece = flat[start:start + step]
            staged = buffer[:piece.numel()]
            done += _read_exact(fd, offset + done, _bytes(staged))
            piece.copy_(staged)
    return done


def write_from(fd: int, offset: int, view: torch.Tensor) -> int:
    """Write `view`'s elements (row-major) to the file at `offset`; return the bytes written."""
    done = 0
    for block in blocks(view):
        buf = _bytes(block)
        while len(buf):
            n = os.pwritev(fd, [buf], offset + done)
            done += n
            buf = buf[n:]
    return done
