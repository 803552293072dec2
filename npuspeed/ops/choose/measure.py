"""The trials behind `Chooser.pick`: a warm-up round that checks each candidate against the
baseline (and measures its bytes where the criterion reads them), then interleaved timed rounds."""
from __future__ import annotations

import contextlib
import time

import torch

from npuspeed.ops import _dispatch
from npuspeed.ops.choose import trial as trials
from npuspeed.ops.choose.record import Choice


def _warm_up(chooser, candidates, inputs, grads, measure_bytes: bool):
    """Each candidate once, baseline first: {name: Run} of those that ran and agree, their
    first time, their peak bytes (when measured) and {name: why dropped}."""
    runs, first, nbytes, dropped, reference = {}, {}, {}, {}, None
    meter = chooser.guard.meter() if measure_bytes and hasattr(chooser.guard, "meter") else None
    base = chooser.baseline
    for name in [base] + [n for n in candidates if n != base]:
        run = trials.Run(candidates[name], inputs, grads)
        try:
            run.prepare()
            start_bytes = meter[0]() if meter else 0
            chooser.clock.sync()
            start = time.perf_counter()
            out = run()
            chooser.clock.sync()
            first[name] = time.perf_counter() - start
            if meter:
                nbytes[name] = meter[1](start_bytes)
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is dropped
            if name == base:
                raise
            dropped[name] = f"raised {type(exc).__name__}: {str(exc)[:80]}"
            continue
        if name == base:
            reference = out
        elif chooser.check and not trials.agrees(out, reference):
            dropped[name] = f"output differs from Megatron's ({trials.gap(out, reference)})"
            continue
        runs[name] = run
    return runs, first, nbytes, dropped


def _scope(chooser, grads):
    stack = contextlib.ExitStack()
    stack.enter_context(chooser.guard())
    stack.enter_context(_dispatch.quiet())
    stack.enter_context(trials.trial_scope())
    if grads:
        stack.enter_context(torch.enable_grad())
    return stack


def _bytes_text(nbytes) -> str:
    return ", ".join(f"{n} {v / 2**20:.1f} MiB" for n, v in nbytes.items())


def untimed(chooser, op, text, candidates, inputs, grads, declared, why) -> Choice:
    """No timing decides: the bytes (declared, or measured by a warm-up where the criterion reads
    them), then the preference order."""
    nbytes, dropped = dict(declared or {}), {}
    names = list(candidates)
    if not nbytes and getattr(chooser.criterion, "reads_bytes", False) and hasattr(chooser.guard, "meter"):
        with _scope(chooser, grads):
            runs, _first, nbytes, dropped = _warm_up(chooser, candidates, inputs, grads, True)
        names = list(runs)
    impl = chooser.criterion.decide(names, {}, nbytes, chooser.baseline, chooser.ordered(candidates))
    if nbytes:
        why = f"{why}, chosen by bytes ({_bytes_text(nbytes)})"
    return Choice(op, text, impl, why, {}, dropped, nbytes, chooser.baseline)


def timed(chooser, op, text, candidates, inputs, grads, declared) -> Choice:
    """Warm-up, then at least `repeats` interleaved timed rounds (up to 4x while cheap); the
    criterion decides on the minimum per candidate. The warm-up's times are never a sample:
    a first call holds one-off costs (Triton's JIT, torch.compile's compile, a library's
    first launch), which are kept apart as each candidate's first-call time (`first_ms`)."""
    reads_bytes = getattr(chooser.criterion, "reads_bytes", False)
    with _scope(chooser, grads):
        runs, first, nbytes, dropped = _warm_up(chooser, candidates, inputs, grads, reads_bytes and not declared)
        nbytes = dict(declared) if declared else nbytes
        best = {name: float("inf") for name in runs}
        spent, rounds = 0.0, 0
        extra = 4 * chooser.repeats if chooser.adaptive else chooser.repeats
        while rounds < chooser.repeats or (rounds < extra and spent < chooser.budget_s):
            for name, run in runs.items():
                seconds = chooser.trial(name, run)
                best[name] = min(best[name], seconds)
                spent += seconds
            rounds += 1
            if rounds == 1 and chooser.adaptive and chooser.real_clock and spent > chooser.budget_s:
                # an expensive op (seconds per fwd+bwd on a slow backend): one timed round is
                # the sample; repeating it would cost more than any difference it can find
                break
    if chooser.agree is not None:  # every candidate in one order on every rank; inf = dropped here
        names = sorted(candidates)
        agreed = chooser.agree(op, names, [best.get(n, float("inf")) for n in names])
        for name, seconds in zip(names, agreed):
            if name in best and seconds == float("inf"):
                dropped[name] = "dropped on another rank"
        best = {n: s for n, s in zip(names, agreed) if n in best and s != float("inf")}
        if chooser.baseline not in best:
            raise RuntimeError(f"fused {op}: Megatron's path did not run on every rank")
    ms = {name: s * 1e3 for name, s in best.items()}
    impl = chooser.criterion.decide(list(ms), ms, nbytes, chooser.baseline, chooser.ordered(candidates))
    first_ms = {name: first[name] * 1e3 for name in ms if name in first}
    return Choice(op, text, impl, _why(chooser, impl, ms, nbytes, grads, dropped, inputs, first_ms), ms, dropped,
                  nbytes, chooser.baseline, first_ms=first_ms, offered=list(candidates))


#: a first call this much longer than the candidate's timed minimum (and over FIRST_FLOOR_MS)
#: held a one-off cost (a compile, a JIT): `why` names it
FIRST_FACTOR, FIRST_FLOOR_MS = 10.0, 10.0


def _why(chooser, impl, ms, nbytes, grads, dropped, inputs, first_ms=None) -> str:
    base = chooser.baseline
    others = ", ".join(f"{n} {v:.3f}" for n, v in sorted(ms.items(), key=lambda kv: kv[1]))
    pass_ = "fwd+bwd" if grads else "fwd"
    if chooser.real_clock and chooser.clock.cpu(inputs):
        pass_ += " CPU time"
    if impl == base:
        why = f"Megatron's path is {'fastest' if not nbytes else 'chosen'} here: {others} ms {pass_}"
    else:
        why = f"{ms[base] / ms[impl]:.2f}x megatron: {others} ms {pass_}"
    if nbytes:
        why += f"; {chooser.criterion.describe()}: {_bytes_text(nbytes)}"
    slow_first = {n: f for n, f in (first_ms or {}).items()
                  if f > FIRST_FLOOR_MS and f > FIRST_FACTOR * ms.get(n, float("inf"))}
    if slow_first:
        why += ("; first call (compile/JIT, not counted) "
                + ", ".join(f"{n} {f / 1e3:.2f} s" for n, f in sorted(slow_first.items())))
    if dropped:
        why += "; dropped " + ", ".join(f"{n} ({r})" for n, r in dropped.items())
    return why
