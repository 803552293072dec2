"""One optimizer's states (and fp32 masters) in host memory between steps, streamed by chunks.

`OptimizerSwap` sits on a Megatron optimizer's inner torch optimizer. At rest every swapped
tensor (Adam's exp_avg / exp_avg_sq, any per-parameter state of the parameter's shape, and the
fp32 masters it was given) has a host copy in pinned memory and no device storage
(`untyped_storage().resize_(0)`: the tensor objects, and so every reference Megatron and the
checkpoint code hold, stay the same). A step splits the inner optimizer's parameters into
chunks of at most `chunk_bytes` and, on two side streams (in and out: the link's two
directions run at once), copies chunk k+1 in while chunk k is updated, and chunk k out (its
storage then freed) while chunk k+1 is updated: the device holds about three chunks. The update of a chunk is the inner optimizer's own `step` with its param
groups cut down to the chunk's parameters, so every element goes through the same arithmetic
as without the swap (Adam's update is elementwise) and losses stay bitwise equal.

Outside a Megatron step (a checkpoint's state_dict, a load, Megatron's dummy step that creates
states before a sharded load) everything is brought in first and stays in until the next step
sends it out again. With a sizer (sizer.py, --swap-optimizer-mode) the first steps move every
chunk and are timed; from the decision on, the chunks whose copies would not hide behind the
updates stay resident on the device (brought in once), and the moved ones are brought in while
the previous moved chunk updates. All stream, event and pinned-memory calls go through the accelerator; on
the CPU backend the streams are the in-order null stream and the "host" copy is ordinary memory.
"""
from __future__ import annotations

import contextlib

import torch

from npuspeed import telemetry

#: counters: steps, chunks_in, chunks_out, bytes_in, bytes_out, materialize, copies_skipped
PREFIX = "swap_optimizer."


def _own_storage(t: torch.Tensor) -> bool:
    """The tensor is the whole of its storage (so freeing the storage frees only it)."""
    size = t.untyped_storage().nbytes()
    return t.is_contiguous() and t.storage_offset() == 0 and size in (0, t.numel() * t.element_size())


def _resident(t: torch.Tensor) -> bool:
    return t.numel() == 0 or t.untyped_storage().nbytes() > 0


class OptimizerSwap:
    """The swap of one inner torch optimizer. `masters`: its parameters that are fp32 masters
    (copies Megatron keeps beside the model weights) and so leave the device too; the others
    are model weights (fp32 runs, fp32 params of a bf16 model) and stay."""

    def __init__(self, accelerator, inner, masters, chunk_bytes: int, after_update=None, sizer=None):
        self.acc = accelerator
        #: which chunks move (sizer.ChunkSizer: measured on the first steps, then decided); None:
        #: every chunk, every step
        self.sizer = sizer
        #: chunks the sizing keeps on the device for good (their copies would not hide)
        self.resident: set[int] = set()
        self.inner = inner
        self.masters = {id(p) for p in masters}
        self.chunk_bytes = max(int(chunk_bytes), 1)
        #: called with a chunk's params after their update (copies the chunk's masters to the
        #: model weights while they are on the device)
        self.after_update = after_update
        self.host: dict[tuple[int, str], torch.Tensor] = {}
        self.streams = None  # (in, out): the two directions of the link run at once
        #: True inside Megatron's step_with_ready_grads (set by the patches)
        self.in_step = False
        #: True once a chunked step copied every chunk's masters to the model weights
        self.copied = False
        #: (event, chunk index) of the last step, in the order they were issued (tests read it)
        self.order: list = []
        self.chunk_count = 0
        self._orig_step = inner.step
        inner.step = self.step

    # -- what moves ---------------------------------------------------------------------------
    def params(self) -> list:
        return [p for group in self.inner.param_groups for p in group["params"]]

    def tensors(self, p) -> list[tuple[str, torch.Tensor]]:
        """(key, tensor) of parameter `p` that live on the host between steps."""
        out = []
        state = self.inner.state.get(p, {})
        for key, value in list(state.items()):
            if torch.is_tensor(value) and value.shape == p.shape and value.numel() > 0 \
                    and value.device == p.device:
                if not _own_storage(value):  # e.g. a loaded view of a larger tensor: own it
                    value = state[key] = value.clone()
                out.append((key, value))
        if id(p) in self.masters and p.numel() > 0:
            if not _own_storage(p):
                p.data = p.detach().clone()
            out.append(("param", p))
        return out

    def chunks(self) -> list[list]:
        """The parameters in optimizer order, cut where a chunk would pass `chunk_bytes` (states
        counted as Adam's two of the parameter's size, plus the master where swapped)."""
        out, size = [], 0
        for p in self.params():
            nbytes = p.numel() * p.element_size() * (3 if id(p) in self.masters else 2)
            if out and out[-1] and size + nbytes > self.chunk_bytes:
                out.append([])
                size = 0
            if not out:
                out.append([])
            out[-1].append(p)
            size += nbytes
        return out

    def side_streams(self):
        if self.streams is None:
            self.streams = (self.acc.Stream(), self.acc.Stream())
        return self.streams

    def _host(self, p, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.host.get((id(p), key))
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            nbytes = t.numel() * t.element_size()
            buf = self.acc.pinned_empty(nbytes).view(t.dtype).view(t.shape)
            self.host[(id(p), key)] = buf
        return buf

    # -- moving -------------------------------------------------------------------------------
    def bring_in(self, params, k: int = -1, after_out: bool = False):
        """Start copying `params`' swapped tensors to the device on the in stream; the event
        the compute stream waits on before it reads them. `after_out`: first wait for every
        copy out issued so far (their host buffers are what comes in)."""
        acc, (side, out) = self.acc, self.side_streams()
        if after_out:
            side.wait_stream(out)
        todo = []
        for p in params:  # storage allocated on the compute stream, which will use it
            for key, t in self.tensors(p):
                if not _resident(t):
                    host = self.host[(id(p), key)]
                    t.untyped_storage().resize_(host.numel() * host.element_size())
                    todo.append((t, host))
        side.wait_stream(acc.current_stream())  # earlier users of that memory are done
        moved = 0
        with acc.stream(side):
            for t, host in todo:
                t.copy_(host, non_blocking=True)
                moved += host.numel() * host.element_size()
            event = acc.Event()
            event.record(side)
        if moved:
            telemetry.count(PREFIX + "chunks_in")
            telemetry.count(PREFIX + "bytes_in", moved)
        self.order.append(("in", k))
        return event

    def chunk_nbytes(self, chunk) -> int:
        return sum(t.numel() * t.element_size() for p in chunk for _, t in self.tensors(p))

    def send_out(self, params, k: int = -1) -> None:
        """Copy `params`' tensors to their host buffers on the side stream, after the compute
        stream's work so far (the update), and free their device storage."""
        acc, side = self.acc, self.side_streams()[1]
        side.wait_stream(acc.current_stream())
        moved = 0
        for p in params:
            for key, t in self.tensors(p):
                if not _resident(t):
                    continue
                host = self._host(p, key, t)
                with acc.stream(side):
                    host.copy_(t, non_blocking=True)
                acc.record_stream(t, side)  # the allocator keeps the block until the copy is done
                t.untyped_storage().resize_(0)
                moved += host.numel() * host.element_size()
        if moved:
            telemetry.count(PREFIX + "chunks_out")
            telemetry.count(PREFIX + "bytes_out", moved)
        self.order.append(("out", k))

    def materialize(self) -> None:
        """Everything on the device (for a checkpoint or a load); it stays until the next step."""
        params = self.params()
        if any(not _resident(t) for p in params for _, t in self.tensors(p)):
            self.bring_in(params, after_out=True).wait(self.acc.current_stream())
            telemetry.count(PREFIX + "materialize")

    def release(self) -> None:
        """Everything to the host (after the optimizer is built)."""
        self.send_out(self.params())

    def keep_resident(self, resident: set[int], chunks) -> None:
        """From now on the chunks `resident` stay on the device: brought in once, never sent out."""
        self.resident = set(resident)
        params = [p for k in sorted(self.resident) for p in chunks[k]]
        if params:
            self.bring_in(params, after_out=True).wait(self.acc.current_stream())
            for p in params:  # their host copies are not read again
                for key, _ in self.tensors(p):
                    self.host.pop((id(p), key), None)

    def resident_bytes(self) -> int:
        """Device bytes the swapped tensors hold now (0 at rest)."""
        return sum(t.untyped_storage().nbytes() for p in self.params() for _, t in self.tensors(p))

    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.host.values())

    # -- the step -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _only(self, params):
        """The inner optimizer sees only `params` (its groups keep their settings)."""
        keep = {id(p) for p in params}
        saved = [group["params"] for group in self.inner.param_groups]
        try:
            for group in self.inner.param_groups:
                group["params"] = [p for p in group["params"] if id(p) in keep]
            yield
        finally:
            for group, params_ in zip(self.inner.param_groups, saved):
                group["params"] = params_

    def step(self, closure=None):
        if not self.in_step:  # a step outside Megatron's (its dummy state init): all in, as is
            self.materialize()
            return self._orig_step(closure)
        chunks = self.chunks()
        self.order, self.chunk_count = [], len(chunks)
        telemetry.count(PREFIX + "steps")
        sizer = self.sizer
        if sizer is not None:
            decided = sizer.begin_step([self.chunk_nbytes(c) for c in chunks])
            if decided is not None:
                self.keep_resident(decided, chunks)
        acc = self.acc
        moved = [k for k in range(len(chunks)) if k not in self.resident]
        if not moved:  # the sizing keeps everything on the device: the plain step, in one call
            self.copied = False  # Megatron's own main->model copy runs after it
            if sizer is not None:
                sizer.end_step(len(chunks))
            return self._orig_step(closure)
        following = dict(zip(moved, moved[1:]))  # a moved chunk -> the next moved one
        events = {moved[0]: self.bring_in(chunks[moved[0]], moved[0], after_out=True)} if moved else {}
        loss = None
        for k, chunk in enumerate(chunks):
            if k in following:
                nxt = following[k]
                events[nxt] = self.bring_in(chunks[nxt], nxt)  # overlaps chunk k's update
            if sizer is not None:
                sizer.mark("pre", k)
            if k in events:
                events.pop(k).wait(acc.current_stream())
            if sizer is not None:
                sizer.mark("post", k)
            self.order.append(("update", k))
            with self._only(chunk):
                result = self._orig_step(closure)
            loss = result if result is not None else loss
            if self.after_update is not None:
                self.after_update(chunk)
            if sizer is not None:
                sizer.mark("done", k)
            if k not in self.resident:
                self.send_out(chunk, k)
        if sizer is not None:
            sizer.end_step(len(chunks))
        self.copied = self.after_update is not None
        return loss
