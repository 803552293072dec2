"""The measure itself: each pipeline wait (Megatron's send/receive, a deferred wait, a receive of
DualPipeV's), each lone forward/backward chunk, each training step (aligned on the pipeline's ranks
with NPUSPEED_MEASURE_BUBBLE=1), kept in this process's totals until `reset`."""
from __future__ import annotations

import functools
import threading
import time

_lock = threading.Lock()
_totals = {"idle": 0.0, "waits": 0, "forward": 0.0, "forwards": 0, "backward": 0.0, "backwards": 0, "steps": 0,
           "paired": 0.0, "pairs": 0, "transfer": 0.0, "transfers": 0, "tail": 0.0, "tails": 0, "imbalance": 0.0,
           "imbalances": 0}
_clock = {"hop": None, "last_end": 0.0}  # one exchange's seconds (measured once); the last op's end
_steps: list = []  # each aligned step's bubble (waits less transfers, plus the tail, less the imbalance)
# the step's phase, for the waits: warm-up before this rank's first backward, cool-down after its
# last forward, steady between (where the formula's model has no wait: stages of equal, steady cost)
_phase = {"forwards": 0, "backwards": 0, "total": 0}
PHASES = ("warm_up", "steady", "cool_down")
_phase_idle = dict.fromkeys(PHASES, 0.0)
_layout = {"pp": 1, "vpp": 1, "schedule": "interleaved"}
MEASURE_ENV = "NPUSPEED_MEASURE_BUBBLE"
ALIGN_ENV = "NPUSPEED_BUBBLE_ALIGN"  # 0: no barrier at each step's start (the measure as on by default)


def _sync() -> None:
    from npuspeed.accelerator import get_accelerator

    get_accelerator().synchronize()


def _add(key: str, count: str, seconds: float) -> None:
    with _lock:
        _totals[key] += seconds
        _totals[count] += 1


def _waited(seconds: float) -> None:
    """A pipeline wait; the part of it one exchange would take anyway is the transfer."""
    _add("idle", "waits", seconds)
    with _lock:
        _phase_idle[_current_phase()] += seconds
    if _clock["hop"] is not None:
        _add("transfer", "transfers", min(seconds, _clock["hop"]))


def _current_phase() -> str:
    if not _phase["backwards"]:
        return "warm_up"
    return "cool_down" if _phase["forwards"] >= _phase["total"] else "steady"


class _TimedWork:
    """A request the schedule waits on later (`--overlap-p2p-comm`): its wait is the idle time."""

    __slots__ = ("_work",)

    def __init__(self, work):
        self._work = work

    def wait(self, *args, **kwargs):
        _sync()
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            _waited(time.perf_counter() - t0)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _deferred(reqs):
    if isinstance(reqs, dict):
        return {k: _TimedWork(v) for k, v in reqs.items()}
    if isinstance(reqs, list):
        return [_TimedWork(v) for v in reqs]
    return reqs


def communicate_wrapper(original):
    @functools.wraps(original)
    def communicate(*args, **kwargs):
        waits = kwargs.get("wait_on_reqs", True)
        _sync()
        t0 = time.perf_counter()
        try:
            out = original(*args, **kwargs)
        finally:
            if waits:
                _sync()
                _waited(time.perf_counter() - t0)
        if waits or not isinstance(out, tuple) or len(out) != 3:
            return out
        return out[0], out[1], _deferred(out[2])  # waited on later: each wait is timed then

    return communicate


class _Call:
    __slots__ = ("overlapped",)

    def __init__(self, overlapped: bool):
        self.overlapped = overlapped


_running: set = set()


def _timed(key: str, count: str):
    """A call counts only when no other forward/backward ran during it (a pair's halves do)."""

    def wrap(original):
        @functools.wraps(original)
        def run(*args, **kwargs):
            _sync()
            with _lock:
                call = _Call(bool(_running))
                for other in _running:
                    other.overlapped = True
                _running.add(call)
            t0 = time.perf_counter()
            try:
                out = original(*args, **kwargs)
                _sync()
            finally:
                with _lock:
                    _running.discard(call)
                    _clock["last_end"] = time.perf_counter()
                    _phase[key + "s"] += 1
            if not call.overlapped:
                _add(key, count, time.perf_counter() - t0)
            return out

        return run

    return wrap


forward_step_wrapper = _timed("forward", "forwards")
backward_step_wrapper = _timed("backward", "backwards")


def schedule_wrapper(original):
    """Counts the training steps of a pipelined schedule and notes its layout. With
    NPUSPEED_MEASURE_BUBBLE=1 the pipeline ranks start each step together (a barrier, not
    counted): what a rank waits for then is the schedule's bubble, not another rank's longer
    optimizer step or data loading before it (measured without it too: the bench's A/B)."""

    @functools.wraps(original)
    def schedule(*args, **kwargs):
        if not kwargs.get("forward_only", False):
            import os

            from megatron.core import parallel_state

            model = kwargs.get("model", args[1] if len(args) > 1 else None)
            _layout["pp"] = parallel_state.get_pipeline_model_parallel_world_size()
            _layout["vpp"] = len(model) if isinstance(model, list) else 1
            with _lock:
                _totals["steps"] += 1
                _phase.update(forwards=0, backwards=0, total=kwargs.get("num_microbatches", 0) * _layout["vpp"])
            if os.environ.get(MEASURE_ENV) == "1" and os.environ.get(ALIGN_ENV, "1") == "1":
                return _aligned(original, args, kwargs, parallel_state.get_pipeline_model_parallel_group())
        return original(*args, **kwargs)

    return schedule


def _aligned(original, args, kwargs, group):
    """One step started together on the pipeline's ranks; each rank's end and busy time (its
    step less its waits) gathered at the end."""
    import torch.distributed as dist

    _sync()
    dist.barrier(group=group)
    if _clock["hop"] is None:
        _clock["hop"] = _exchange_seconds(kwargs, group)
        dist.barrier(group=group)
    with _lock:
        idle0, transfer0 = _totals["idle"], _totals["transfer"]
    start = _clock["last_end"] = time.perf_counter()
    out = original(*args, **kwargs)
    with _lock:
        waited, transfers = _totals["idle"] - idle0, _totals["transfer"] - transfer0
    end = _clock["last_end"] - start
    ranks = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, (end, end - waited), group=group)
    tail = max(e for e, _ in ranks) - end
    imbalance = max(b for _, b in ranks) - (end - waited)
    _add("tail", "tails", tail)
    _add("imbalance", "imbalances", imbalance)
    with _lock:
        _steps.append(waited - transfers + tail - imbalance)
    return out


def _exchange_seconds(kwargs, group, rounds: int = 8) -> float:
    """Mean seconds of one ring exchange of a pipeline message (send to the next rank and
    receive from the previous at once, after one untimed), with the schedule's message shape."""
    import torch
    import torch.distributed as dist
    from megatron.core.utils import get_model_config

    from npuspeed.accelerator import get_accelerator
    from npuspeed.features.pipeline.message import message_shape

    model = kwargs.get("model")
    config = get_model_config(model[0] if isinstance(model, list) else model)
    dtype = getattr(config, "pipeline_dtype", None) or config.params_dtype
    send = torch.ones(message_shape(config, kwargs["seq_length"], kwargs["micro_batch_size"]), dtype=dtype,
                      device=get_accelerator().device())
    recv = torch.empty_like(send)
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    nxt, prev = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]
    total = 0.0
    for i in range(rounds + 1):
        t0 = time.perf_counter()
        ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prev, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        _sync()
        total += (time.perf_counter() - t0) if i else 0.0
    return total / rounds


def reset() -> None:
    with _lock:
        for key in _totals:
            _totals[key] = 0 if isinstance(_totals[key], int) else 0.0
        _steps.clear()
        for key in PHASES:
            _phase_idle[key] = 0.0


def note_schedule(name: str) -> None:
    """Which schedule's formula applies (npuspeed's DualPipeV says so at each step)."""
    _layout["schedule"] = name


def record_pair(seconds: float) -> None:
    """One paired step (a forward beside a backward) of DualPipeV's order took this long."""
    _add("paired", "pairs", seconds)


def record_wait(seconds: float) -> None:
    """A pipeline receive of a schedule of npuspeed's own (DualPipeV's) blocked this long."""
    _waited(seconds)


def snapshot() -> dict:
    """A copy of the totals, the aligned steps' bubbles, the exchange's seconds, the layout and the
    waits by phase, taken at once (summary.py computes the figures from it)."""
    with _lock:
        return {"totals": dict(_totals), "steps": list(_steps), "hop": _clock["hop"], "layout": dict(_layout),
                "phase_idle": dict(_phase_idle)}
