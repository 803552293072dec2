"""The host<->device link: one nominal figure per backend, and this process's measured one.

Two users, two needs. The planner (`npuspeed plan`, the adaptive policy at import) prices
copies for a device that may not be this machine's, and every rank must price them alike
before any process group exists: it reads the nominal table (HOST_LINK_BYTES_PER_S; cuda is
PCIe 5 x16 with pinned buffers, ~25 GB/s achieved of 64, npu an Ascend 910B's host link,
~20 GB/s, cpu a single-threaded memcpy, ~5 GB/s; none measured here), or the figure
NPUSPEED_HOST_LINK_GBS sets for every rank alike. The swaps (`--swap-attention`,
`--swap-optimizer`) size what they move on this device from `link(acc)`: the link measured once
per process, the first time a swap asks (a pinned host buffer copied to the device and back,
timed by the device's own events; on a backend whose tensors live in host memory the "link"
is a memcpy, timed by the host clock, and `overlaps` is False: an in-order backend cannot hide
a copy behind compute, so the sizing moves nothing there). Tests set a fake link (`fake`).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass

HOST_LINK_BYTES_PER_S = {"cuda": 25e9, "npu": 20e9, "cpu": 5e9}
#: a number of GB/s (both directions) or "TO_DEVICE,TO_HOST": skips the measurement
ENV = "NPUSPEED_HOST_LINK_GBS"
#: bytes one measurement copies each way, and how many times (the fastest counts: the first
#: copy pays the driver's set-up)
MEASURE_BYTES = 64 * 2**20
MEASURE_REPEATS = 3


def host_link_bytes_per_s(backend: str) -> float:
    """The nominal figure for `backend` (a torch device type), or NPUSPEED_HOST_LINK_GBS's (the
    smaller direction) where it is set; an unknown backend is a clear error."""
    env = _from_env()
    if env is not None:
        return min(env.to_device, env.to_host)
    try:
        return HOST_LINK_BYTES_PER_S[backend]
    except KeyError:
        raise ValueError(f"no host-link figure for backend {backend!r}: "
                         f"add it to npuspeed/accelerator/host_link.py") from None


@dataclass(frozen=True)
class LinkFigures:
    """Bytes per second each way, whether copies can run beside compute, and where the figures
    come from (for the log and `npuspeed report`)."""

    to_device: float
    to_host: float
    overlaps: bool
    source: str

    def seconds(self, nbytes: float, to_device: bool) -> float:
        return nbytes / (self.to_device if to_device else self.to_host)

    def line(self) -> str:
        rates = (f"{self.to_device / 1e9:.1f} GB/s to the device, {self.to_host / 1e9:.1f} GB/s to the host"
                 if self.to_device or self.to_host else "not measured")
        order = "" if self.overlaps else "; copies run in order with compute: none can hide"
        return f"host link {rates} ({self.source}{order})"

    def as_dict(self) -> dict:
        return dict(asdict(self), line=self.line())


_MEASURED: dict[str, LinkFigures] = {}
_FAKE: list[LinkFigures] = []


def _from_env(overlaps: bool = True) -> LinkFigures | None:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        parts = [float(x) * 1e9 for x in raw.split(",")]
        if len(parts) not in (1, 2) or min(parts) <= 0:
            raise ValueError
    except ValueError:
        from npuspeed.accelerator.errors import AcceleratorError

        raise AcceleratorError(f"{ENV}={raw!r}: give a positive number of GB/s (both directions) or "
                               "TO_DEVICE,TO_HOST, e.g. 25 or 26,24; or unset it to measure the link") from None
    return LinkFigures(parts[0], parts[-1], overlaps, f"{ENV}={raw}")


def overlaps(acc) -> bool:
    """Whether copies to and from `acc` can run beside its compute, answered without measuring
    (a fake's answer in tests): an in-order backend's cannot, whatever the link carries. A
    sizing that needs no figures asks this instead of `link` (the CPU's measurement alone holds
    two 64 MiB buffers)."""
    return _FAKE[-1].overlaps if _FAKE else _in_parallel(acc)


def _in_parallel(acc) -> bool:
    return bool(acc.has_streams()) and not acc.host_is_device()


def unmeasured(acc) -> LinkFigures:
    """The link as a decision that needs no figures records it: no rate, whether copies overlap."""
    return LinkFigures(0.0, 0.0, overlaps(acc), "not measured: no copy can hide on this backend")


def link(acc) -> LinkFigures:
    """This process's link for `acc`: a fake (tests), NPUSPEED_HOST_LINK_GBS, or measured once."""
    if _FAKE:
        return _FAKE[-1]
    env = _from_env(overlaps(acc))
    if env is not None:
        return env
    found = _MEASURED.get(acc.name)
    if found is None:
        found = _MEASURED[acc.name] = measure(acc)
    return found


def known(name: str) -> LinkFigures | None:
    """The figures this process already has for backend `name` (None: not measured yet)."""
    return _FAKE[-1] if _FAKE else _MEASURED.get(name)


def measure(acc, nbytes: int = MEASURE_BYTES, repeats: int = MEASURE_REPEATS) -> LinkFigures:
    """Time `nbytes` host->device and device->host, fastest of `repeats` each way."""
    import time

    import torch

    in_parallel = _in_parallel(acc)
    if acc.host_is_device():  # the "link" is a memcpy within host memory, timed by the host clock
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(1)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        rate = nbytes / max(best, 1e-9)
        return LinkFigures(rate, rate, in_parallel, f"measured: {nbytes >> 20} MiB memcpy in host memory, fastest of "
                                                  f"{repeats}")
    host = acc.pinned_empty(nbytes)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=acc.device())
    times = {True: float("inf"), False: float("inf")}
    for _ in range(repeats):
        for to_device in (True, False):
            start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
            acc.synchronize()
            start.record(acc.current_stream())
            if to_device:
                dev.copy_(host, non_blocking=True)
            else:
                host.copy_(dev, non_blocking=True)
            end.record(acc.current_stream())
            end.synchronize()
            times[to_device] = min(times[to_device], start.elapsed_time(end) / 1e3)
    del dev
    return LinkFigures(nbytes / max(times[True], 1e-9), nbytes / max(times[False], 1e-9), in_parallel,
                       f"measured: {nbytes >> 20} MiB pinned copies each way, fastest of {repeats}")


@contextlib.contextmanager
def fake(to_device: float, to_host: float | None = None, overlaps: bool = True):
    """A link of the given bytes/s for the duration (tests)."""
    _FAKE.append(LinkFigures(float(to_device), float(to_host if to_host is not None else to_device), overlaps,
                             "fake link (test)"))
    try:
        yield _FAKE[-1]
    finally:
        _FAKE.pop()


def reported() -> dict:
    """What `npuspeed report` shows: the links this process measured (by backend)."""
    out = {name: f.as_dict() for name, f in _MEASURED.items()}
    if _FAKE:
        out["fake"] = _FAKE[-1].as_dict()
    return out
