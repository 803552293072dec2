"""How much a swap moves: only what the host link can carry behind the compute it overlaps.

Both swaps copy on side streams while the compute stream works; a copy that is not done when
its data is needed makes the compute stream wait, and that wait is what a swap costs. Given
the link (accelerator/host_link.py: measured bytes/s each way) and the compute time of each
unit measured on the run's own first steps, the functions here replay the swap's own schedule
(which copy is issued when, which stream it queues on, what waits for it) and return the
compute stream's wait for a chosen set of units. `decide` then picks, in the feature's order,
every unit whose copies still hide with a margin (transfers priced at 1/MARGIN of their
measured time), or, in the explicit `whole` mode, every unit, with its estimated cost.

Nothing here reads a backend's name: an in-order backend (no side streams: the CPU) has
`overlaps` False, so every copy's time is added to the compute it would have hidden behind.

Two schedules (the features' mechanisms, swap.py and swapper.py):

* layers (`--swap-attention`): unit i (forward order) is copied out on the out stream once its
  forward window ends, the copies queue; in backward, unit i is fetched on the in stream when
  the unit above starts its backward (the top unit on demand, when its own backward starts),
  after its copy out is done, and unit i's backward waits for the fetch.
* chunks (`--swap-optimizer`): a moved chunk is brought in on the in stream when the previous
  moved chunk's update starts (the first at the step's start, after the previous step's copies
  out), its update waits for it, and it is sent out on the out stream after its update; the
  copies out still running when the step ends must finish within the gap before the next step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: a transfer counts as hidden when it fits in this share of the compute it overlaps
MARGIN = 0.8
#: waits below this many seconds are rounding, not cost
EPS = 1e-7
MODES = ("hidden", "whole")


@dataclass(frozen=True)
class LayerUnit:
    """One swap group per micro-batch (a layer's chosen module): its bytes, the compute from its
    forward start to the next unit's (the top one: to its own backward start), and from its
    backward start to the next lower unit's (the bottom one: unused)."""

    name: str
    nbytes: int
    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class Chunk:
    """One optimizer chunk per step: its bytes (states and masters) and its update's time."""

    name: str
    nbytes: int
    update_s: float


@dataclass
class Decision:
    """What moves, what it costs, and why the rest stays."""

    feature: str
    mode: str
    units: int
    moved: list[str]
    kept: dict[str, str]  # unit -> why it stays on the device
    bytes_moved: int  # per micro-batch (layers) or per step (chunks), each way
    bytes_total: int  # what the whole saving would move
    transfer_s: float  # the moved bytes' time over the link, both ways
    exposed_s: float  # the compute stream's estimated wait (no margin)
    compute_s: float  # the measured compute the copies overlap
    link: dict = field(default_factory=dict)
    per: str = "micro-batch"

    @property
    def hidden_share(self) -> float:
        return 1.0 if self.transfer_s <= 0 else max(0.0, 1.0 - self.exposed_s / self.transfer_s)

    def line(self) -> str:
        gib = self.bytes_moved / 2**30
        head = (f"{self.feature} sizing ({self.mode}): moves {len(self.moved)} of {self.units} "
                f"{'units' if self.per == 'micro-batch' else 'chunks'}, {gib:.3f} GiB each way a {self.per} "
                f"({self.transfer_s * 1e3:.2f} ms of copies at the {self.link.get('source', 'link')})")
        if self.mode == "whole":
            return (head + f"; cost: about {self.exposed_s * 1e3:.2f} ms a {self.per} not hidden behind "
                    f"{self.compute_s * 1e3:.2f} ms of compute ({self.hidden_share:.0%} hidden)")
        tail = f"; estimated {self.hidden_share:.0%} hidden" if self.moved else "; the run is the plain one"
        if self.kept:
            name, why = next(iter(self.kept.items()))
            tail += (f"; keeps {len(self.kept)} on the device whose copies would not hide (first: {name}: {why}); "
                     f"the whole saving whatever it costs: {self.feature}-mode whole")
        return head + tail

    def as_dict(self) -> dict:
        return {"feature": self.feature, "mode": self.mode, "units": self.units, "moved": list(self.moved),
                "kept": dict(self.kept), "bytes_moved": self.bytes_moved, "bytes_total": self.bytes_total,
                "per": self.per, "transfer_ms": self.transfer_s * 1e3, "exposed_ms_estimated": self.exposed_s * 1e3,
                "compute_ms": self.compute_s * 1e3, "hidden_share_estimated": self.hidden_share,
                "link": dict(self.link), "line": self.line()}


def _t(link, nbytes: float, to_device: bool, margin: float) -> float:
    return link.seconds(nbytes, to_device) / margin


def layers_wait(units: list[LayerUnit], moved: set[int], link, margin: float = 1.0) -> float:
    """Seconds the compute stream waits in one forward and backward pass when the units at the
    indices `moved` are swapped (the layer schedule above)."""
    n = len(units)
    if not moved:
        return 0.0
    if not link.overlaps:  # in order: every copy is compute's own time
        return sum(_t(link, units[i].nbytes, False, margin) + _t(link, units[i].nbytes, True, margin)
                   for i in moved)
    # forward: compute points, copies out queued on the out stream
    start, t = [], 0.0
    for u in units:
        start.append(t)
        t += u.forward_s
    out_free, out_end = 0.0, {}
    for i in sorted(moved):
        begin = max(start[i] + units[i].forward_s, out_free)
        out_free = out_end[i] = begin + _t(link, units[i].nbytes, False, margin)
    # backward, top unit first: planned start of each unit's backward, shifted by the waits so far
    planned_b, delay, in_free = t, 0.0, 0.0
    actual = {}
    for i in range(n - 1, -1, -1):
        if i < n - 1:
            planned_b += units[i + 1].backward_s
        ready = planned_b + delay
        if i in moved:
            issue = actual[i + 1] if i < n - 1 else ready
            begin = max(issue, in_free, out_end[i])
            in_free = begin + _t(link, units[i].nbytes, True, margin)
            if in_free > ready:
                delay += in_free - ready
                ready = in_free
        actual[i] = ready
    return delay


def chunks_wait(chunks: list[Chunk], moved: set[int], link, gap_s: float, margin: float = 1.0) -> float:
    """Seconds the compute stream waits in one optimizer step (and at the next step's start for
    copies out that outlast `gap_s`, the compute between two steps) when `moved` chunks swap."""
    if not moved:
        return 0.0
    if not link.overlaps:
        return sum(_t(link, chunks[k].nbytes, True, margin) + _t(link, chunks[k].nbytes, False, margin)
                   for k in moved)
    t, in_free, out_free, prev_start = 0.0, 0.0, 0.0, 0.0
    busy = 0.0
    for k, c in enumerate(chunks):
        begin = t
        if k in moved:
            issue = prev_start  # brought in while the previous moved chunk updates (the first: at once)
            in_free = max(issue, in_free) + _t(link, c.nbytes, True, margin)
            begin = max(t, in_free)
            prev_start = begin
        t = begin + c.update_s
        busy += c.update_s
        if k in moved:
            out_free = max(t, out_free) + _t(link, c.nbytes, False, margin)
    spill = max(0.0, out_free - t - gap_s)
    return (t - busy) + spill


#: why a unit stays where the link cannot overlap compute
IN_ORDER = "copies run in order with compute on this backend: none can hide"


def decide(feature: str, mode: str, units: list, wait, link, compute_s: float, per: str = "micro-batch",
           margin: float = MARGIN) -> Decision:
    """The units to move. `wait(moved, margin)`: the compute stream's wait for a set of indices.
    hidden: in order, each unit that keeps the wait (with the margin) at zero is added, the
    others kept with the wait they would add; whole: all of them."""
    n = len(units)
    if mode not in MODES:
        raise ValueError(f"sizing mode {mode!r}: one of {', '.join(MODES)}")
    kept: dict[str, str] = {}
    if mode == "whole":
        moved = set(range(n))
    else:
        moved = set()
        for i in range(n):
            extra = wait(moved | {i}, margin) - wait(moved, margin)
            if extra <= EPS:
                moved.add(i)
            elif not link.overlaps:
                kept[units[i].name] = IN_ORDER
            else:
                kept[units[i].name] = (f"its copies ({_t(link, units[i].nbytes, True, 1.0) * 1e3:.2f} ms each way) "
                                       f"would add {extra * 1e3:.2f} ms of wait with the {margin:.0%} margin")
    nbytes = sum(units[i].nbytes for i in moved)
    return Decision(feature=feature, mode=mode, units=n, moved=[units[i].name for i in sorted(moved)], kept=kept,
                    bytes_moved=nbytes, bytes_total=sum(u.nbytes for u in units),
                    transfer_s=link.seconds(nbytes, True) + link.seconds(nbytes, False),
                    exposed_s=wait(moved, 1.0), compute_s=compute_s, link=link.as_dict(), per=per)


def size_layers(feature: str, mode: str, units: list[LayerUnit], link, margin: float = MARGIN) -> Decision:
    compute = sum(u.forward_s + u.backward_s for u in units)
    d = decide(feature, mode, units, lambda moved, m: layers_wait(units, moved, link, m), link, compute,
               margin=margin)
    if units and link.overlaps and units[-1].name in d.kept:
        d.kept[units[-1].name] = ("the top unit: no unit above it starts its fetch (fetched when its own backward "
                                  "starts), so its fetch cannot hide")
    return d


def size_chunks(feature: str, mode: str, chunks: list[Chunk], link, gap_s: float, margin: float = MARGIN) -> Decision:
    compute = sum(c.update_s for c in chunks) + gap_s
    return decide(feature, mode, chunks, lambda moved, m: chunks_wait(chunks, moved, link, gap_s, m), link, compute,
                  per="step", margin=margin)
