"""The swap sizing decisions this process made (sizing.Decision), with what was measured after
each: `npuspeed report` (`swap_sizing`) and the example's `--summary-json` read them."""
from __future__ import annotations

_DECISIONS: list = []


def record(decision) -> None:
    _DECISIONS.append(decision)


def checked(decision, exposed_s: float, samples: int) -> None:
    """The compute stream's measured wait per micro-batch (or step) after the decision."""
    decision.measured_exposed_s = exposed_s
    decision.measured_samples = samples


def all_dicts() -> list[dict]:
    out = []
    for d in _DECISIONS:
        row = d.as_dict()
        measured = getattr(d, "measured_exposed_s", None)
        row["exposed_ms_measured"] = None if measured is None else measured * 1e3
        row["hidden_share_measured"] = (None if measured is None else
                                        1.0 if d.transfer_s <= 0 else max(0.0, 1.0 - measured / d.transfer_s))
        row["measured_samples"] = getattr(d, "measured_samples", 0)
        out.append(row)
    return out


def reset() -> None:
    _DECISIONS.clear()
