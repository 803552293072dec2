"""Each rank's pipeline bubble per step, measured, beside the schedule's formula for it.

Idle: the time this rank spent blocked in Megatron's pipeline send/receive (`_communicate`,
or, where `--overlap-p2p-comm` defers the waits, each wait on its requests) with the device
drained first, so the time is the wait and not queued compute. F and B: the mean `forward_step` and
`backward_step` of one model chunk and micro-batch, from the calls that ran alone (a paired
forward and backward overlap, so neither half is one chunk's cost). The interleaved schedule's
bubble is (PP-1)(F+B)/v in whole-stage units, (PP-1)(F+B) in the chunk units measured here, the
same expression without VPP (v = 1). The example reports it as `pipeline_bubble`.

The formula is the step's length beyond one stage's work, for stages of equal cost and free
transfers; every rank of the pipeline idles it (one that ends early waits for the others at the
gradient reduction). With NPUSPEED_MEASURE_BUBBLE=1 (ranks start each step together) the
measure takes the same terms: each wait less one measured exchange of a pipeline message (a
ring send/receive of its shape, timed once at the first step: what a receive costs when its data
has already been sent); plus the rank's tail, from its last forward/backward to the pipeline's
last; less its imbalance, how much less busy (its step less its waits) it was than the busiest
rank (ends and busy times gathered, relative to the common start). That is the step's length
beyond the busiest rank's work, less this rank's transfers: the median over the steps (a stall
of a shared host in one step is not the schedule's) is `bubble_ms_per_step`. The raw mean wait
stays `idle_ms_per_step`, by phase in `idle_ms_per_step_by_phase`.
"""
from __future__ import annotations

import functools
import statistics
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
    from npuspeed.features.dualpipev.links import message_shape

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


def summary() -> dict | None:
    """{idle_ms_per_step, forward_ms, backward_ms, formula_ms, measured_over_formula, pp, vpp,
    steps}; None before a pipelined training step ran."""
    with _lock:
        t = dict(_totals)
    if not t["steps"] or _layout["pp"] < 2:
        return None
    f = t["forward"] / t["forwards"] if t["forwards"] else None
    b = t["backward"] / t["backwards"] if t["backwards"] else None
    idle = t["idle"] / t["steps"]
    pair = t["paired"] / t["pairs"] if t["pairs"] else None
    formula = _formula(_layout["schedule"], _layout["pp"], f, b, pair)
    adjusted = {}
    with _lock:
        steps = list(_steps)
    if steps:  # the median step: a host stall in one step (a shared CPU) is not the schedule's
        bubble = statistics.median(steps)
        adjusted = {"hop_ms": (_clock["hop"] or 0.0) * 1e3, "transfer_ms_per_step": t["transfer"] / t["steps"] * 1e3,
                    "tail_ms_per_step": t["tail"] / t["tails"] * 1e3,
                    "imbalance_ms_per_step": t["imbalance"] / t["imbalances"] * 1e3, "bubble_ms_per_step": bubble * 1e3,
                    "bubble_over_formula": bubble / formula if formula else None}
    with _lock:
        adjusted["idle_ms_per_step_by_phase"] = {k: v / t["steps"] * 1e3 for k, v in _phase_idle.items()}
    return adjusted | {"idle_ms_per_step": idle * 1e3, "forward_ms": f and f * 1e3, "backward_ms": b and b * 1e3,
            "formula_ms": formula and formula * 1e3,
            "measured_over_formula": idle / formula if formula else None,
            "pp": _layout["pp"], "vpp": _layout["vpp"], "steps": t["steps"], "waits": t["waits"],
            "schedule": _layout["schedule"], "pair_ms": pair and pair * 1e3, "formula": FORMULAS[_layout["schedule"]]}


FORMULAS = {"interleaved": "(PP-1)(F+B)", "dualpipev": "(PP-1)(F&B+B-3W), W=0"}


def _formula(schedule: str, pp: int, f, b, pair):
    """The schedule's bubble in chunk units: the interleaved schedule's (PP-1)(F+B); DualPipeV's
    (PP-1)(F&B + B - 3W) (DeepSeek's DualPipe README for PP ranks of a V), with F&B a paired
    step's time (F + B where none was timed) and W = 0 (no dense weight-gradient split here): what
    the V order, replayed with those costs, idles (tests/unit/test_plan_dualpipev.py)."""
    if f is None or b is None:
        return None
    if schedule == "dualpipev":
        return (pp - 1) * ((pair if pair is not None else f + b) + b)
    return (pp - 1) * (f + b)


def note_schedule(name: str) -> None:
    """Which schedule's formula applies (npuspeed's DualPipeV says so at each step)."""
    _layout["schedule"] = name


def record_pair(seconds: float) -> None:
    """One paired step (a forward beside a backward) of DualPipeV's order took this long."""
    _add("paired", "pairs", seconds)


def line(s: dict) -> str:
    ratio = s["measured_over_formula"]
    return (f"pipeline bubble: {s['idle_ms_per_step']:.1f} ms idle a step on this rank (PP {s['pp']}, VPP {s['vpp']}, "
            f"{s['schedule']}); formula {s['formula']} = {s['formula_ms'] or float('nan'):.1f} ms from F "
            f"{s['forward_ms'] or float('nan'):.1f} ms, "
            f"B {s['backward_ms'] or float('nan'):.1f} ms a chunk"
            + (f", F&B {s['pair_ms']:.1f} ms" if s.get("pair_ms") else "") + "; measured/formula "
            + (f"{ratio:.2f}" if ratio is not None else "n/a") + _adjusted(s))


def _adjusted(s: dict) -> str:
    if "bubble_ms_per_step" not in s:
        return ""
    ratio = s["bubble_over_formula"]
    return (f"; less {s['transfer_ms_per_step']:.1f} ms of transfers (one exchange {s['hop_ms']:.2f} ms), plus "
            f"{s['tail_ms_per_step']:.1f} ms waiting for the pipeline's end, less {s['imbalance_ms_per_step']:.1f} ms "
            f"of stage imbalance: {s['bubble_ms_per_step']:.1f} ms, bubble/formula "
            + (f"{ratio:.2f}" if ratio is not None else "n/a"))


P2P = "megatron.core.pipeline_parallel.p2p_communication"
SCHEDULES = "megatron.core.pipeline_parallel.schedules"
MEASURE_ENV = "NPUSPEED_MEASURE_BUBBLE"
ALIGN_ENV = "NPUSPEED_BUBBLE_ALIGN"  # 0: no barrier at each step's start (the measure as on by default)


def measuring(ctx) -> bool:
    """At PP > 1: on CPU always (draining the host is free), on a device only with
    NPUSPEED_MEASURE_BUBBLE=1 (draining it at every send/receive and chunk would cost time)."""
    import os

    if (ctx.megatron.pipeline_model_parallel_size or 1) < 2:
        return False
    from npuspeed.accelerator.devices import for_device

    # a device with streams queues work the drains would wait for; the host runs it at once
    return not for_device(ctx.accelerator.name).has_streams() or os.environ.get(MEASURE_ENV) == "1"


def record_wait(seconds: float) -> None:
    """A pipeline receive of a schedule of npuspeed's own (DualPipeV's) blocked this long."""
    _waited(seconds)


def register_chunk_timers(registry, feature: str) -> None:
    """Registered first, so innermost: a pair's forward and backward are the timed calls."""
    registry.register(f"{SCHEDULES}.forward_step", wrapper=forward_step_wrapper, feature=feature)
    registry.register(f"{SCHEDULES}.backward_step", wrapper=backward_step_wrapper, feature=feature)


def register_for_megatron(registry, ctx, feature: str, paired: bool) -> None:
    """With NPUSPEED_MEASURE_BUBBLE=1 and neither --moe-fb-overlap nor DualPipeV on (`paired`: they
    register the measure themselves): Megatron's own pipelined schedules measured, the baseline of
    benchmarks/bench_pipeline_bubble.py (registered by the device feature, always on)."""
    import os

    if os.environ.get(MEASURE_ENV) != "1" or paired:
        return
    register(registry, ctx, feature)


def register(registry, ctx, feature: str) -> None:
    """Megatron's pipelined schedules measured, where `measuring` says."""
    if not measuring(ctx):
        return
    register_chunk_timers(registry, feature)
    registry.register(f"{P2P}._communicate", wrapper=communicate_wrapper, feature=feature, megatron="<0.14")
    registry.register(f"{P2P}.P2PCommunicator._communicate", wrapper=communicate_wrapper, feature=feature,
                      megatron=">=0.14")
    for name in ("forward_backward_pipelining_with_interleaving", "forward_backward_pipelining_without_interleaving"):
        registry.register(f"{SCHEDULES}.{name}", wrapper=schedule_wrapper, feature=feature)
