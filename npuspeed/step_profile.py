"""Where one training step's time goes: a profiler trace's events sorted into GEMM, attention,
norm, other elementwise, memory copies, optimizer, communication and idle time.

Megatron-LM's `--profile` writes a trace to look at by hand; the device report needs the same
step as a few numbers it can put in a table next to the compute floor (npuspeed/compute_floor.py).
This module reads torch.profiler's Chrome-trace events (plain dicts: `name`, `cat`, `ts` and
`dur` in microseconds, `tid`), so it runs on a trace recorded anywhere and is tested on a
made-up event list without a profiler.

The step is the span of the `STEP` annotation the training loop opens around each profiled
iteration (several spans: their sum, reported per step), the optimizer the `OPTIMIZER` spans
inside it. Two modes, chosen by what the trace holds:

- device (CUDA kernels present): each kernel and device copy inside a step is timed by its
  own duration; `idle` is the step's wall time not covered by any kernel (the host launching,
  waiting, synchronising: the gaps an accelerator idles in). Kernels on concurrent streams
  can overlap: then the categories add up to more than the busy time (`overlap_ms`).
- host (no kernels: the CPU backend): every operator's self time (its duration less that of
  the operators it called) on the step's thread; `idle` is the wall time outside any
  operator's own work (Python, the framework, the autograd engine's bookkeeping, waiting on
  nothing measurable).

Names are sorted by the patterns below, first match wins, after two rules that come first:
a collective is communication wherever it runs; anything else inside an optimizer span is
the optimizer (its elementwise updates look like any other elementwise kernel by name).
"""
from __future__ import annotations

import re
from collections import defaultdict

STEP = "npuspeed/step"
OPTIMIZER = "npuspeed/optimizer"

#: the categories, in the order tables show them; `idle` is time, not a kernel's
CATEGORIES = ("gemm", "attention", "norm", "elementwise", "memcpy", "optimizer", "communication", "idle")

#: category -> pattern over the lower-cased event name (first match wins, in this order)
PATTERNS = (
    ("communication", re.compile(r"nccl|hccl|gloo|c10d::|record_param_comms|all_?reduce|all_?gather|"
                                 r"reduce_?scatter|all_?to_?all|broadcast|\bsend\b|\brecv\b")),
    ("optimizer", re.compile(r"multi_tensor_apply|adam|optimizer")),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|scaled_dot_product|attn")),
    ("gemm", re.compile(r"gemm|gemv|cutlass|cublas|nvjet|xmma|matmul|\baten::(mm|addmm|bmm|baddbmm|addbmm|linear|"
                        r"_addmm_activation|addmv|mv|dot)\b|mkldnn|onednn|splitkreduce|_mm_")),
    ("norm", re.compile(r"rms_?norm|layer_?norm|norm_(fwd|bwd)")),
    ("memcpy", re.compile(r"^memcpy|^memset|\bmemcpy\b|\bmemset\b")),
)
#: trace categories of device work (kernels and the copy engines)
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def classify(name: str, in_optimizer: bool = False, cat: str | None = None) -> str:
    """One event's category: communication by name first, then the optimizer span, then the
    name patterns; device copies (`gpu_memcpy`/`gpu_memset`) are memcpy; the rest elementwise,
    except, among host operators (`cpu_op`), the autograd engine's and Python autograd
    functions' own time (no `ns::` operator name and no pattern, e.g. `MulBackward0`): that is the
    framework's, counted with the host's idle time."""
    low = name.lower()
    if PATTERNS[0][1].search(low):
        return "communication"
    if in_optimizer:
        return "optimizer"
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "memcpy"
    for category, pattern in PATTERNS[1:]:
        if pattern.search(low):
            return category
    if cat == "cpu_op" and (low.startswith("autograd::") or "::" not in low):
        return "idle"
    return "elementwise"


def _spans(events: list[dict], name: str) -> list[tuple[float, float, object]]:
    return sorted((e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in events
                  if e.get("cat") == "user_annotation" and e.get("name") == name and e.get("dur") is not None)


def _inside(t0: float, t1: float, spans) -> bool:
    return any(a <= t0 and t1 <= b for a, b, _ in spans)


def _clip(t0: float, t1: float, spans) -> float:
    """Length of [t0, t1] inside the spans (which do not overlap)."""
    return sum(max(0.0, min(t1, b) - max(t0, a)) for a, b, _ in spans)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def self_times(ops: list[dict]) -> list[tuple[dict, float]]:
    """(op, self time) for one thread's operators: its duration less its direct children's
    (the trace nests them by time; an op that starts inside another and ends inside it is its child)."""
    out, stack = [], []  # stack of [op, end, children's total]
    for op in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        end = op["ts"] + op["dur"]
        while stack and op["ts"] >= stack[-1][1]:
            done = stack.pop()
            out.append((done[0], max(0.0, done[0]["dur"] - done[2])))
        if stack:
            stack[-1][2] += op["dur"]
        stack.append([op, end, 0.0])
    out.extend((op, max(0.0, op["dur"] - kids)) for op, _, kids in reversed(stack))
    return out


def breakdown(events: list[dict], top: int = 15) -> dict:
    """The profiled steps' time by category (ms per step and share of the step), the busy and
    idle time, and the `top` most expensive kernels (operators on the host) by total time.
    Raises ValueError when the trace has no `STEP` span (the loop did not annotate it)."""
    steps = _spans(events, STEP)
    if not steps:
        raise ValueError(f"the trace has no {STEP!r} span: profile a step of the training loop")
    optimizer = _spans(events, OPTIMIZER)
    wall = sum(b - a for a, b, _ in steps)
    device = [e for e in events if e.get("cat") in DEVICE_CATS and e.get("dur") is not None]
    if device:
        mode, idle_means = "device", "step wall time with no kernel or copy running on the device"
        items = [(e, _clip(e["ts"], e["ts"] + e["dur"], steps)) for e in device]
        items = [(e, t) for e, t in items if t > 0]
        busy = _union([(max(e["ts"], a), min(e["ts"] + e["dur"], b)) for e, _ in items for a, b, _ in steps
                       if e["ts"] < b and e["ts"] + e["dur"] > a])
    else:
        mode, idle_means = "host", "step wall time outside any operator's own work (Python, framework, waits)"
        threads = {tid for _, _, tid in steps}
        ops = [e for e in events if e.get("cat") == "cpu_op" and e.get("tid") in threads and e.get("dur") is not None
               and _inside(e["ts"], e["ts"] + e["dur"], steps)]
        items = self_times(ops)
        busy = None  # the operators' own work: known once classified
    per_cat, per_name = defaultdict(float), defaultdict(lambda: [0.0, 0])
    for e, t in items:
        cat = classify(e["name"], _inside(e["ts"], e["ts"], optimizer), e.get("cat"))  # started in it
        per_cat[cat] += t
        row = per_name[(e["name"], cat)]
        row[0] += t
        row[1] += 1
    if busy is None:
        busy = sum(t for c, t in per_cat.items() if c != "idle")
    n = len(steps)
    idle = max(0.0, wall - busy)
    per_cat["idle"] = idle
    ms = {c: per_cat.get(c, 0.0) / n / 1000.0 for c in CATEGORIES}
    step_ms = wall / n / 1000.0
    kernels = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "mode": mode, "steps": n, "step_ms": step_ms, "idle_means": idle_means,
        "ms": ms, "share": {c: (v / step_ms if step_ms else 0.0) for c, v in ms.items()},
        "busy_ms": busy / n / 1000.0,
        "overlap_ms": max(0.0, sum(per_cat[c] for c in CATEGORIES if c != "idle") - busy) / n / 1000.0,
        "top": [{"name": name[:160], "category": cat, "ms": t / n / 1000.0, "calls": calls / n,
                 "share": t / wall if wall else 0.0} for (name, cat), (t, calls) in kernels],
    }


def trace_events(trace) -> list[dict]:
    """The complete ('X') events of a Chrome trace (its dict, or the list of its events)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e]
