"""Collectives in flight, and the chunked engine that overlaps them with the matmuls.

A collective is launched with `async_op=True` and waited on only when its result is
needed. On gloo the work runs on the process group's own threads while this thread
multiplies the next chunk. On CUDA/NPU it is launched from a separate communication stream
(`get_accelerator().Stream()`), which first waits for the compute stream (its input is
ready), and the compute stream waits for it back before the result is read.

Every launch is counted (telemetry `coc.collective.<kind>`), so a test can prove that N
chunked collectives ran; layer passes are `coc.call.<path>`.
"""
from __future__ import annotations

import torch

from npuspeed import telemetry
from npuspeed.accelerator.base import NullStream
from npuspeed.features.coc_overlap.chunking import chunk_count

#: counter prefixes: collectives launched by kind ("all_gather", "reduce_scatter",
#: "all_reduce", "mc2:<op>"), and layer passes by path ("column_sp.forward", ...)
COLLECTIVE, CALL = "coc.collective.", "coc.call."


def counted(prefix: str) -> dict[str, int]:
    """The counters under COLLECTIVE or CALL, by kind/path."""
    return {name[len(prefix):]: n for name, n in telemetry.snapshot(prefix).items()}


def reset_counts() -> None:
    telemetry.reset(COLLECTIVE)
    telemetry.reset(CALL)
_COMM_STREAMS: dict = {}


class Pending:
    """Collectives whose result is `value` once `wait()` returns; holds its tensors alive."""

    def __init__(self, value, works=(), stream=None, acc=None, keep=()):
        self.value, self._works, self._stream, self._acc, self._keep = value, list(works), stream, acc, keep

    def wait(self):
        for work in self._works:
            if work is not None:
                work.wait()
        if self._stream is not None:
            self._acc.current_stream().wait_stream(self._stream)
        self._works, self._keep = [], ()
        return self.value


class Collectives:
    """Async collectives on one tensor-parallel group, counted, on a side stream where streams exist."""

    def __init__(self, group, acc):
        self.group, self.acc = group, acc
        self.size = torch.distributed.get_world_size(group)
        self.stream = _comm_stream(acc)

    def _launch(self, kind: str, value, call, keep=()) -> Pending:
        telemetry.count(COLLECTIVE + kind)
        if self.stream is None:
            return Pending(value, [call()], keep=keep)
        self.stream.wait_stream(self.acc.current_stream())
        with self.acc.stream(self.stream):
            work = call()
        return Pending(value, [work], self.stream, self.acc, keep)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Pending:
        dist = torch.distributed
        return self._launch("all_gather", out, lambda: dist.all_gather_into_tensor(
            out, inp, group=self.group, async_op=True), keep=(inp,))

    def all_gather_rows(self, outs: list, inp: torch.Tensor) -> Pending:
        """all_gather into a list of per-rank tensors (any placement; the backend copies)."""
        dist = torch.distributed
        return self._launch("all_gather", outs, lambda: dist.all_gather(
            outs, inp, group=self.group, async_op=True), keep=(inp,))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> Pending:
        dist = torch.distributed
        return self._launch("reduce_scatter", out, lambda: dist.reduce_scatter_tensor(
            out, inp, group=self.group, async_op=True), keep=(inp,))

    def all_reduce(self, tensor: torch.Tensor) -> Pending:
        dist = torch.distributed
        return self._launch("all_reduce", tensor, lambda: dist.all_reduce(
            tensor, group=self.group, async_op=True))


def _comm_stream(acc):
    """One communication stream per accelerator; None where kernels already run in order."""
    if isinstance(acc.current_stream(), NullStream):
        return None
    key = (acc.name, acc.current_device())
    if key not in _COMM_STREAMS:
        _COMM_STREAMS[key] = acc.Stream()
    return _COMM_STREAMS[key]


def gather_buffer(shape, like: torch.Tensor) -> torch.Tensor:
    """Scratch for a gathered input: Megatron's global "mpu" buffer, as its own SP all-gather
    uses (so peak memory matches Megatron's), or a fresh tensor outside Megatron."""
    try:
        from megatron.core.parallel_state import get_global_memory_buffer

        return get_global_memory_buffer().get_tensor(list(shape), like.dtype, "mpu")
    except (ImportError, AssertionError, AttributeError):
        return like.new_empty(shape)


def _all_done(value, pendings: list[Pending]) -> Pending:
    """One Pending for several: waiting on it waits on each."""
    merged = Pending(value)
    merged.wait = lambda: ([p.wait() for p in pendings], value)[1]
    return merged


class ChunkedEngine:
    """all-gather+matmul, matmul+reduce-scatter and matmul+all-reduce in N row chunks.

    Shapes are 2-D: x [rows, k], w_t [k, n]. Rank r's rows are rows r*m..(r+1)*m of the
    gathered (or pre-reduce-scatter) matrix, as in the unchunked collective. Each chunk's
    matmul is one call per rank block, written straight into contiguous rows of the result
    (no reordering copy on the compute path). Results are fresh tensors, never views (they
    become autograd outputs).
    """

    name = "chunked"

    def __init__(self, n: int, comm: Collectives, note=None):
        self.n, self.comm, self.note = n, comm, note

    def ag_mm(self, x: torch.Tensor, w_t: torch.Tensor, keep_gathered: bool = False):
        """(all_gather(x) @ w_t, all_gather(x) or None); x holds this rank's m rows."""
        p, (m, k) = self.comm.size, x.shape
        n = chunk_count(m, self.n, "all-gather+matmul", self.note)
        c = m // n
        x = x.contiguous()
        gathered = None
        if keep_gathered:  # rank-major, as wgrad needs it: each chunk lands in its rows directly
            gathered = x.new_empty(p * m, k)
            pending = [self.comm.all_gather_rows([gathered[r * m + i * c:r * m + (i + 1) * c] for r in range(p)],
                                                 x[i * c:(i + 1) * c]) for i in range(n)]

            def src(i, r):
                return gathered[r * m + i * c:r * m + (i + 1) * c]
        else:  # chunk i: [rank 0 rows i, rank 1 rows i, ...] in Megatron's shared scratch
            buf = gather_buffer((p * m, k), x).view(n, p * c, k)
            pending = [self.comm.all_gather(buf[i], x[i * c:(i + 1) * c]) for i in range(n)]

            def src(i, r):
                return buf[i, r * c:(r + 1) * c]
        out = x.new_empty(p * m, w_t.shape[1])
        for i in range(n):
            pending[i].wait()
            for r in range(p):
                torch.matmul(src(i, r), w_t, out=out[r * m + i * c:r * m + (i + 1) * c])
        return out, gathered

    def mm_rs(self, x: torch.Tensor, w_t: torch.Tensor) -> Pending:
        """reduce_scatter(x @ w_t): x holds all p*m rows; rank r gets rows r*m..(r+1)*m."""
        p = self.comm.size
        m = x.shape[0] // p
        n = chunk_count(m, self.n, "matmul+reduce-scatter", self.note)
        c = m // n
        x = x.contiguous()
        parts = x.new_empty(n, p * c, w_t.shape[1])  # the size of Megatron's unreduced output
        out = x.new_empty(m, w_t.shape[1])
        pending = []
        for i in range(n):  # chunk i: rows i*c..(i+1)*c of every rank's block
            for r in range(p):
                torch.matmul(x[r * m + i * c:r * m + (i + 1) * c], w_t, out=parts[i, r * c:(r + 1) * c])
            pending.append(self.comm.reduce_scatter(out[i * c:(i + 1) * c], parts[i]))
        return _all_done(out, pending)

    def mm_ar(self, x: torch.Tensor, w_t: torch.Tensor) -> Pending:
        """all_reduce(x @ w_t), chunk by chunk of rows."""
        m = x.shape[0]
        n = chunk_count(m, self.n, "matmul+all-reduce", self.note)
        c = m // n
        out = x.new_empty(m, w_t.shape[1])
        pending = []
        for i in range(n):
            rows = out[i * c:(i + 1) * c]
            torch.matmul(x[i * c:(i + 1) * c], w_t, out=rows)
            pending.append(self.comm.all_reduce(rows))
        return _all_done(out, pending)
