"""Inside a pipelined schedule call whose steps pair a forward with a backward (Megatron's
interleaved one under --moe-fb-overlap, or DualPipeV's): the scope that says so, which the
experts' weight-gradient split asks (moe_fb_overlap/wgrad.py), and what the backward's worker
thread runs first (turns.py runs the pair)."""
from __future__ import annotations

import contextlib


def device_setup(acc):
    """The worker thread starts on device 0: put it on this thread's device."""
    index = acc.current_device()
    return lambda: acc.set_device(index)


_SETUP: list = []


def pairing() -> bool:
    """Inside a call of a pipelined schedule that pairs its steps (Megatron's interleaved one, or
    DualPipeV's), not a serial one."""
    return bool(_SETUP)


def worker_setup():
    """What the backward's worker thread runs first, inside a pairing schedule call."""
    return _SETUP[-1] if _SETUP else None


@contextlib.contextmanager
def pairing_scope(acc):
    """A pipelined schedule call whose steps pair (the experts' dW split arms inside it)."""
    _SETUP.append(device_setup(acc))
    try:
        yield
    finally:
        _SETUP.pop()
