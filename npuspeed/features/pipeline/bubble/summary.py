"""The bubble's figures (`summary`, the example's `pipeline_bubble`), the schedule's formula
beside them, and the log line (`line`)."""
from __future__ import annotations

import statistics

from npuspeed.features.pipeline.bubble import measure


def summary() -> dict | None:
    """{idle_ms_per_step, forward_ms, backward_ms, formula_ms, measured_over_formula, pp, vpp,
    steps}; None before a pipelined training step ran."""
    state = measure.snapshot()
    t, layout = state["totals"], state["layout"]
    if not t["steps"] or layout["pp"] < 2:
        return None
    f = t["forward"] / t["forwards"] if t["forwards"] else None
    b = t["backward"] / t["backwards"] if t["backwards"] else None
    idle = t["idle"] / t["steps"]
    pair = t["paired"] / t["pairs"] if t["pairs"] else None
    formula = _formula(layout["schedule"], layout["pp"], f, b, pair)
    adjusted = {}
    steps = state["steps"]
    if steps:  # the median step: a host stall in one step (a shared CPU) is not the schedule's
        bubble = statistics.median(steps)
        adjusted = {"hop_ms": (state["hop"] or 0.0) * 1e3, "transfer_ms_per_step": t["transfer"] / t["steps"] * 1e3,
                    "tail_ms_per_step": t["tail"] / t["tails"] * 1e3,
                    "imbalance_ms_per_step": t["imbalance"] / t["imbalances"] * 1e3, "bubble_ms_per_step": bubble * 1e3,
                    "bubble_over_formula": bubble / formula if formula else None}
    adjusted["idle_ms_per_step_by_phase"] = {k: v / t["steps"] * 1e3 for k, v in state["phase_idle"].items()}
    return adjusted | {"idle_ms_per_step": idle * 1e3, "forward_ms": f and f * 1e3, "backward_ms": b and b * 1e3,
            "formula_ms": formula and formula * 1e3,
            "measured_over_formula": idle / formula if formula else None,
            "pp": layout["pp"], "vpp": layout["vpp"], "steps": t["steps"], "waits": t["waits"],
            "schedule": layout["schedule"], "pair_ms": pair and pair * 1e3, "formula": FORMULAS[layout["schedule"]]}


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


