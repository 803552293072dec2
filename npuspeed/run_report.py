"""The report of one finished run: `npuspeed report --run SUMMARY [--baseline SUMMARY]`.

`npuspeed report` alone describes what *would* run in a fresh process with the flags it is given;
a training run's own choices (the paths its choosers took on its shapes, its counters, its
speed and memory) exist only inside that run. The example therefore stores its rank 0 report
(`reporting.collect()` at the end of training) in its `--summary-json` under `npuspeed_report`,
and this module renders it, beside a run of the same model without the flags when one is given
(`make example` runs both in one command, so the two figures come from the same machine state).
"""
from __future__ import annotations

import json

from npuspeed.errors import UserError


def load(path: str, flag: str) -> dict:
    """A summary written by the example's --summary-json; one clear line when it is not one."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot read it ({exc.strerror}); pass the file the example's "
                        "--summary-json wrote") from None
    except ValueError as exc:
        raise UserError(f"{flag} {path}: not JSON ({exc}); pass the file the example's --summary-json wrote") from None
    if not isinstance(data, dict) or "tokens_per_s" not in data:
        raise UserError(f"{flag} {path}: not a training summary (no tokens_per_s); pass the file the "
                        "example's --summary-json wrote")
    return data


def comparison(run: dict, base: dict | None) -> dict:
    """Speed and memory of the run, and against the baseline run when there is one."""
    out = {key: run.get(key) for key in ("tokens_per_s", "median_step_ms", "peak_mem_bytes", "iterations")}
    out["final_loss"] = (run.get("losses") or [None])[-1]
    out["enabled_features"] = _enabled(run)
    if base is not None:
        out["baseline"] = {key: base.get(key) for key in ("tokens_per_s", "median_step_ms", "peak_mem_bytes",
                                                           "iterations")}
        out["baseline"]["final_loss"] = (base.get("losses") or [None])[-1]
        out["baseline"]["enabled_features"] = _enabled(base)
        out["tokens_per_s_ratio"] = _ratio(run.get("tokens_per_s"), base.get("tokens_per_s"))
        out["peak_mem_ratio"] = _ratio(run.get("peak_mem_bytes"), base.get("peak_mem_bytes"))
    return out


def _enabled(summary: dict) -> list[str] | None:
    report = summary.get("npuspeed_report")
    if not report or "features" not in report:
        return None
    return [f["name"] for f in report["features"] if f["enabled"] and f["name"] != "device"]


def _ratio(a, b) -> float | None:
    return a / b if a and b else None


def render(run: dict, base: dict | None, patches: bool = False) -> str:
    from npuspeed.reporting import render as render_report

    report = run.get("npuspeed_report")
    if not report:
        raise UserError("--run: this summary has no npuspeed_report (written by an older example); train "
                        "again with --summary-json to get the run's own report")
    if "error" in report:
        raise UserError(f"--run: the run could not collect its own report ({report['error']}); run "
                        "`npuspeed report` with the run's flags, or report the error")
    cmp = comparison(run, base)
    out = [render_report(report, patches=patches), "", "this run:"]
    out.append("  " + _speed_line(cmp, cmp.get("enabled_features")))
    if base is not None:
        b = cmp["baseline"]
        out.append("  " + _speed_line(b, b.get("enabled_features")))
        tps, peak = cmp["tokens_per_s_ratio"], cmp["peak_mem_ratio"]
        out.append(f"  with the flags: {_x(tps)} the tokens/s and {_x(peak)} the peak memory of the run "
                   f"without them (measured in the same command; on {report['device']})")
    return "\n".join(out)


def _speed_line(figures: dict, enabled) -> str:
    names = ", ".join(enabled) if enabled else "no npuspeed feature"
    peak = figures.get("peak_mem_bytes")
    loss = figures.get("final_loss")
    return (f"[{names}] {figures.get('tokens_per_s') or 0:,.0f} tokens/s, median step "
            f"{figures.get('median_step_ms') or 0:.1f} ms, peak {peak / 2**20 if peak else 0:,.1f} MiB, "
            f"final loss {loss if loss is None else f'{loss:.4f}'} ({figures.get('iterations')} iterations)")


def _x(value) -> str:
    return "n/a" if value is None else f"{value:.2f}x"
