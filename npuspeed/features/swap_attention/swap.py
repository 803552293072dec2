"""Saved activations of one module call moved to host memory in forward, back in backward.

A `SwapGroup` is one call of a chosen module (one layer's attention, one micro-batch). While
it runs, `torch.autograd.graph.saved_tensors_hooks` hands it every tensor autograd saves: a
parameter, a leaf or a tensor below `min_bytes` is kept as is; any other is copied, one copy
per storage (q, k and v viewing one QKV output share it), into a pinned host buffer on the
"out" side stream, and autograd keeps only a handle, so the device storage goes once the forward drops
its last reference (the caching allocator is told the side stream still reads it). In
backward the first unpack of a group fetches it (if the prefetch did not already) and starts
the fetch of the group that ran before it in that forward pass: one layer ahead, on the "in"
side stream (a second stream, so fetches never queue behind copies out), overlapped with this
layer's backward; the compute stream waits on the fetch's event before it reads. With a sizer
(sizer.py, --swap-attention-mode) only the groups it chose copy; the others keep their saves
on the device but still start the fetch of the group below when their backward begins. Views are rebuilt over the fetched storage with their own size, stride and
offset, so values and gradients are bit for bit those of the run without swap.

All stream, event and pinned-memory calls go through the accelerator; on the CPU backend the
side stream is the in-order null stream and the "host" buffer is ordinary memory (the host is
the device there: the mechanics run, nothing is saved).
"""
from __future__ import annotations

import weakref

import torch

from npuspeed import telemetry
from npuspeed.features import freed_outputs

#: counters: groups, out_bytes, in_bytes, prefetched (fetched ahead of use), on_demand, kept,
#: skipped_recomputed (a norm output --recompute-norm frees and recomputes: left to it)
PREFIX = "swap."


class SwapManager:
    """The groups of this process in forward order, the side stream, and an ordering log."""

    def __init__(self, accelerator, min_bytes: int = 0, log_order: bool = False, sizer=None):
        self.acc = accelerator
        self.min_bytes = min_bytes
        #: which groups copy (sizer.LayerSizer: measured, then decided); None: every group
        self.sizer = sizer
        self.streams = {}  # "out" and "in": the link's two directions run at once
        self.last: SwapGroup | None = None
        #: ("out" | "fetch" | "use", group name) in the order they happened (tests read it)
        self.order: list | None = [] if log_order else None

    def side_stream(self, direction: str = "out"):
        """The stream copies of `direction` ("out": to host, "in": to the device) run on: two, so
        a backward's fetches never queue behind the forward's copies out."""
        if direction not in self.streams:
            self.streams[direction] = self.acc.Stream()
        return self.streams[direction]

    def note(self, what: str, group: "SwapGroup") -> None:
        if self.order is not None:
            self.order.append((what, group.name))

    def group(self, name: str, layer: int) -> "SwapGroup":
        """A new group for one call; its predecessor is the group of the previous layer in this
        forward pass (the last one made, when it belongs to a lower layer)."""
        prev = self.last if self.last is not None and self.last.layer < layer else None
        rec, swaps = (None, True) if self.sizer is None else self.sizer.new_group(name, prev is None)
        g = SwapGroup(self, name, layer, prev, swaps, rec)
        self.last = g
        telemetry.count(PREFIX + ("groups" if swaps else "groups_kept"))
        return g


class _Swapped:
    """One device storage, copied out: its host buffer and, once fetched, its device copy."""

    __slots__ = ("host", "nbytes", "device", "device_storage", "event")

    def __init__(self, host, nbytes, device):
        self.host, self.nbytes, self.device = host, nbytes, device
        self.device_storage = None
        self.event = None


class SwapGroup:
    """`swaps` False: a group the sizing keeps on the device; it still hooks, so that the start
    of its backward fetches the group below it (and is timed) as a swapped one's does."""

    def __init__(self, manager: SwapManager, name: str, layer: int, prev, swaps: bool = True, rec=None):
        self.m, self.name, self.layer, self.prev = manager, name, layer, prev
        self.swaps, self.rec = swaps, rec
        #: whether the call needs the saved-tensor hooks: it copies, or the group below it does
        #: (its backward starts that fetch), or the sizer times this pass; otherwise the module
        #: runs as it is (a hook per saved tensor costs time a kept layer need not pay)
        sizer = manager.sizer
        self.hooked = swaps or (prev is not None and prev.swaps) or (
            sizer is not None and rec is not None and sizer.timed(rec))
        self.storages: dict[tuple, _Swapped] = {}
        self.alive: dict[int, weakref.ref] = {}  # address -> the storage copied from it
        self.keys: dict[int, tuple] = {}
        self.fetched = False
        self.used = False

    # -- forward ------------------------------------------------------------------------------
    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        if not self.swaps:
            return ("keep", t)
        nbytes = t.untyped_storage().nbytes()
        if isinstance(t, torch.nn.Parameter) or (t.grad_fn is None and t.requires_grad) or nbytes <= self.m.min_bytes \
                or nbytes == 0:
            telemetry.count(PREFIX + "kept")
            return ("keep", t)
        if freed_outputs.frees(t):  # --recompute-norm frees and recomputes it: a copy would be paid twice
            telemetry.count(PREFIX + "skipped_recomputed")
            return ("keep", t)
        # one copy per live storage; an address freed and reused inside the call is another one
        storage = t.untyped_storage()
        key = storage.data_ptr()
        known = self.alive.get(key)
        if known is None or known() is not storage:
            key = (key, len(self.storages))
            self.storages[key] = self._copy_out(t, nbytes)
            self.alive[storage.data_ptr()] = weakref.ref(storage)
            self.keys[storage.data_ptr()] = key
        else:
            key = self.keys[storage.data_ptr()]
        return ("swap", key, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.requires_grad)

    def _copy_out(self, t: torch.Tensor, nbytes: int) -> _Swapped:
        acc = self.m.acc
        host = acc.pinned_empty(nbytes)
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        s = _Swapped(host, nbytes, t.device)
        side = self.m.side_stream()
        side.wait_stream(acc.current_stream())  # the tensor is written by the compute stream
        with acc.stream(side):
            host.copy_(src, non_blocking=True)
            s.event = acc.Event()
            s.event.record(side)
        acc.record_stream(src, side)  # its storage may go now: the allocator waits for the copy
        telemetry.count(PREFIX + "out_bytes", nbytes)
        if self.rec is not None:
            self.rec.out_bytes += nbytes
        self.m.note("out", self)
        return s

    # -- backward -----------------------------------------------------------------------------
    def _begin_backward(self) -> None:
        """The first unpack: fetch this group if the prefetch did not, start the fetch of the group
        below, and wait for this group's copies (timed before and after the wait when sized)."""
        self.used = True
        sizer, rec = self.m.sizer, self.rec
        if sizer is not None and rec is not None:
            sizer.mark(rec, "pre")
        if self.swaps:
            telemetry.count(PREFIX + ("prefetched" if self.fetched else "on_demand"))
            self.fetch()
            self.m.note("use", self)
        if self.m.last is self:
            self.m.last = None  # nothing keeps a group once autograd is done with it
        prev, self.prev = self.prev, None
        if prev is not None:
            prev.fetch()  # one layer ahead: overlapped with this layer's backward
        if self.storages:  # fetched on one stream in order: the last copy's event covers them all
            list(self.storages.values())[-1].event.wait(self.m.acc.current_stream())
        if sizer is not None and rec is not None:
            sizer.mark(rec, "post")

    def fetch(self) -> None:
        """Start copying every storage of this group back to the device (side stream)."""
        if self.fetched or not self.swaps:
            return
        self.fetched = True
        acc = self.m.acc
        side = self.m.side_stream("in")
        side.wait_stream(acc.current_stream())
        for s in self.storages.values():
            with acc.stream(side):
                s.event.wait(side)  # the copy out is done before its buffer is read back
                dev = torch.empty(s.nbytes, dtype=torch.uint8, device=s.device)
                dev.copy_(s.host, non_blocking=True)
                s.event = acc.Event()
                s.event.record(side)
            s.device_storage = dev
            telemetry.count(PREFIX + "in_bytes", s.nbytes)
        self.m.note("fetch", self)

    def unpack(self, handle):
        if not self.used:
            self._begin_backward()
        if handle[0] == "keep":
            return handle[1]
        _, key, dtype, shape, stride, offset, _ = handle
        s = self.storages[key]
        acc = self.m.acc
        s.event.wait(acc.current_stream())
        dev = s.device_storage
        acc.record_stream(dev, acc.current_stream())
        out = torch.empty(0, dtype=dtype, device=dev.device)
        return out.set_(dev.untyped_storage(), offset, shape, stride)


#: the manager the running process installed (the feature makes one per activation); tests
#: and the report read it
_MANAGERS: list = []


def install(manager: SwapManager) -> SwapManager:
    _MANAGERS[:] = [manager]
    return manager


def current() -> SwapManager | None:
    return _MANAGERS[0] if _MANAGERS else None
