"""Where two dumps part: per dumped step, every slot both runs have is compared (logical.py) with a
relative error, against a tolerance from the two runs' dtypes; the first slot beyond it in forward
order, in backward order and among the parameters is reported, with the slots just before it.

The relative error of two tensors is ||a - b|| / max(||a||, ||b||) (float64). With statistics only
it is the largest of |dNorm| / Norm, |dMax| and |dMin| over the largest magnitude, and |dMean| over
the RMS (Norm / sqrt(numel)):
an error that leaves all four unchanged is not seen at --dump-level stats. A differing NaN or Inf
count is always a divergence.

Tolerance (the larger of the two dtypes'): float32 1e-4 (a few hundred roundings at 2^-24, what a
different reduction order such as TP2 against TP1 leaves through a small model), float16 1e-2,
bfloat16 5e-2 (about six roundings at 2^-8: bf16 against fp32 drifts by this, a real fault 10x
larger does not). `--rtol` overrides it.

Parameter values are compared and reported, but alone they do not make a step "where the runs
part": Adam turns rounding noise in a gradient that is zero in exact arithmetic (the key bias,
which softmax ignores) into a full learning-rate step, so TP1 and TP2 hold visibly different
values there after one update (measured: 1.4e-4 relative on linear_qkv.bias at step 2) while
every activation and gradient agrees. A real fault in an update moves the next forward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from npuspeed.compare import logical

RTOL = {"torch.float32": 1e-4, "torch.float64": 1e-4, "torch.float16": 1e-2, "torch.bfloat16": 5e-2}
BEFORE = 3  # slots shown before the flagged one


def tolerance(*dtypes: str) -> float:
    return max(RTOL.get(d, 1e-4) for d in dtypes)


def rel_error(x, y, tensors: bool) -> float:
    if tensors:
        x, y = x.double(), y.double()
        if not torch.equal(torch.isnan(x), torch.isnan(y)) or not torch.equal(torch.isinf(x), torch.isinf(y)):
            return math.inf
        finite = torch.isfinite(x)
        x, y = x[finite], y[finite]
        scale = max(float(x.norm()), float(y.norm()))
        return float((x - y).norm()) / scale if scale > 0 else 0.0
    if x["NaN"] != y["NaN"] or x["Inf"] != y["Inf"]:
        return math.inf
    if x["Norm"] is None or y["Norm"] is None:
        return 0.0 if x["Norm"] == y["Norm"] else math.inf
    scale = max(x["Norm"], y["Norm"])
    if scale == 0:
        return 0.0
    rms = scale / math.sqrt(max(math.prod(x["shape"]), 1))
    amax = max(abs(v[k]) for v in (x, y) for k in ("Max", "Min") if v[k] is not None) or rms
    errors = [abs(x["Norm"] - y["Norm"]) / scale]
    errors += [abs(x[k] - y[k]) / amax for k in ("Max", "Min") if x[k] is not None and y[k] is not None]
    if x["Mean"] is not None and y["Mean"] is not None:
        errors.append(abs(x["Mean"] - y["Mean"]) / rms)
    return max(errors)


@dataclass
class Compared:
    entry: logical.Entry  # A's
    other: logical.Entry  # B's
    error: float | None  # None: not comparable (see note)
    tol: float
    note: str = ""
    stats: tuple = ()  # (A's logical stats, B's) for the report

    @property
    def over(self) -> bool:
        return self.error is not None and self.error > self.tol

    def as_dict(self) -> dict:
        kind, module, index, slot, i = self.entry.key
        return {"direction": kind, "module": module, "class": self.entry.cls, "micro_batch": index, "slot": slot,
                "position": i, "rel_error": self.error, "tolerance": self.tol, "note": self.note,
                "a": _public(self.stats[0]) if self.stats else None, "b": _public(self.stats[1]) if self.stats else None}


def _public(stats: dict | None) -> dict | None:
    if stats is None:
        return None
    return {k: stats.get(k) for k in ("dtype", "shape", "Min", "Max", "Mean", "Norm", "NaN", "Inf")}


def _stats_of(value, tensors: bool) -> dict:
    if not tensors:
        return value
    from npuspeed.features.dump.stats import describe  # the dump's own statistics, for the report

    return describe(value)


def compare_entry(a: logical.Entry, b: logical.Entry, rtol: float | None) -> Compared:
    tol = rtol if rtol is not None else tolerance(a.dtype, b.dtype)
    tensors = all(p is not None and "data_name" in p for p in a.parts + b.parts)
    got = logical.pairs(a, b, tensors)
    if isinstance(got, str):
        return Compared(a, b, None, tol, got)
    errors = [rel_error(x, y, tensors) for x, y in got]
    worst = max(range(len(errors)), key=lambda k: errors[k])
    x, y = got[worst]
    return Compared(a, b, errors[worst], tol, "tensors" if tensors else "statistics",
                    (_stats_of(x, tensors), _stats_of(y, tensors)))


def compare_step(dump_a, dump_b, step: int, rtol: float | None) -> dict:
    """{"forward"/"backward"/"parameter" (gradients)/"parameter_data": [Compared in order], "skipped": [...]}."""
    ea, eb = logical.entries(dump_a, step), logical.entries(dump_b, step)
    common = sorted(set(ea) & set(eb))
    result = {"forward": [], "backward": [], "parameter": [], "parameter_data": [], "skipped": [], "replicas": common}
    for replica in common:
        a, b = ea[replica], eb[replica]
        for key in sorted(a, key=lambda k: a[k].order):
            if key not in b:
                result["skipped"].append(f"{key[1]} {key[0]} {key[3]}: only in A")
                continue
            done = compare_entry(a[key], b[key], rtol)
            result["parameter_data" if key[0] == "parameter" and key[3] == "data" else key[0]].append(done)
    return result


def first_over(compared: list[Compared]) -> tuple[Compared | None, list[Compared]]:
    for k, c in enumerate(compared):
        if c.over:
            return c, compared[max(0, k - BEFORE):k]
    return None, []
