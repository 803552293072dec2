"""`make device-report`: one command that turns a GPU (or NPU) host into the README's accelerator
figures: the device tier, the example's end-to-end and per-flag runs at 709M parameters, the
reuse-fp32 codec's share of a step and the fused-op tables, within a time budget (8 minutes by
default; what does not fit is reported as not run, never silently left out).

    python benchmarks/device_report/run.py [--out runs/device-report] [--budget-s 480] [--parts ...]
    python benchmarks/device_report/run.py --smoke     # any host (CPU too): the report's own code

Writes report.json (every section, written again after each part), report.md and PNG plots;
`benchmarks/device_report/readme.py` puts report.md into the README. Offline: it needs the
checkout on PYTHONPATH (or `pip install --no-build-isolation --no-deps -e .`), torch, triton and
megatron-core; matplotlib only for the plots.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import parts  # noqa: E402
import render  # noqa: E402
import why  # noqa: E402

PARTS = ("tier", "training", "codec", "fused_ops", "triton_ops") + why.PARTS


def _version(module: str) -> str:
    try:
        from importlib.metadata import version
        return version(module)
    except Exception:  # noqa: BLE001 - a missing package is reported as such
        return "absent"


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=parts.ROOT, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=parts.ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + (" (with local changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git here)"


def meta(smoke: bool, budget_s: float) -> dict:
    from npuspeed import get_accelerator
    acc = get_accelerator()
    return {"date": datetime.date.today().isoformat(), "device": acc.name, "device_name": acc.device_name(),
            "torch": _version("torch"), "triton": _version("triton"), "megatron_core": _version("megatron-core"),
            "python": platform.python_version(), "commit": _commit(), "smoke": smoke, "budget_s": budget_s,
            "host": platform.node()}


def kept(out: Path, now: dict, running) -> dict:
    """The parts of an earlier report in `out` from the same commit, device and kind (smoke or
    not) that this call does not run: a report too long for one lease's call is made in two
    (`--parts tier`, then the rest), each part saying which call measured it."""
    try:
        before = json.loads((out / "report.json").read_text())
    except (OSError, ValueError):
        return {}
    old = before.get("meta", {})
    if any(old.get(k) != now.get(k) for k in ("commit", "device_name", "smoke")):
        return {}
    sections = {name: {**before[name], "measured": before[name].get("measured", old.get("date"))}
                for name in PARTS if name in before and name not in running}
    if sections:
        print(f"[device-report] kept from the earlier call of this commit: {', '.join(sections)}", flush=True)
    return sections


def write(report: dict, out: Path) -> None:
    derived = render.derive(report)
    report["derived"] = derived
    report["plots"] = render.plots(derived, out)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(render.markdown(report, derived))
    print((out / "report.md").read_text())


def render_only(out: Path, tier_log: Path | None) -> int:
    report = json.loads((out / "report.json").read_text())
    if tier_log is not None:
        report["tier"] = parts.tier_from_log(tier_log)
    write(report, out)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(parts.ROOT / "runs" / "device-report"))
    parser.add_argument("--budget-s", type=float, default=480.0, help="the whole report's wall-clock budget")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--smoke", action="store_true", help="a tiny model on whatever device: checks this script")
    parser.add_argument("--runs", nargs="+", choices=list(parts.RUNS), help="the training part runs only these "
                        "(default: all of models.RUNS)")
    parser.add_argument("--tier-log", type=Path, help="take the tier's section from this `pytest -v` log of "
                        "`make test-device` (a tier run in another call) instead of running it")
    parser.add_argument("--render-only", action="store_true", help="measure nothing: rewrite report.md (and "
                        "the tier from --tier-log) from the report.json in --out")
    opts = parser.parse_args(argv)
    if opts.render_only:
        return render_only(Path(opts.out), opts.tier_log)
    if opts.smoke:
        os.environ.setdefault("NPUSPEED_DEVICE", "cpu")
    start = time.monotonic()
    budget = parts.Budget(opts.budget_s)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"meta": meta(opts.smoke, opts.budget_s)}
    report.update(kept(out, report["meta"], opts.parts))
    if report["meta"]["device"] == "cpu" and not opts.smoke:
        print("device report: no CUDA or NPU device here (npuspeed picks cpu); it measures an accelerator. "
              "`--smoke` checks the script on CPU.", file=sys.stderr)
        return 2
    for name in opts.parts:
        t0 = time.monotonic()
        print(f"[device-report] {name} ({budget.left():.0f} s left)", flush=True)
        try:
            if name == "tier" and opts.tier_log:
                section = parts.tier_from_log(opts.tier_log)
            elif name == "tier":  # alone it may take the whole budget (a lease's call of its own)
                cap = budget.left() if opts.parts == ["tier"] else parts.TIER_CAP_S
                section = parts.tier(budget, out, opts.smoke, cap)
            elif name == "codec":
                base = (report.get("training") or {}).get("runs", {}).get("flash-attn") or {}
                section = parts.codec(budget, out, opts.smoke, int((base.get("weight_bytes") or 0) // 6))
            elif name == "training":
                section = parts.training_runs(budget, out, opts.smoke, opts.runs)
            elif name in why.PARTS:
                section = getattr(why, name)(budget, out, opts.smoke)
            else:
                section = getattr(parts, name)(budget, out, opts.smoke)
        except Exception as exc:  # noqa: BLE001 - one part failing is a finding, not the end of the report
            section = {"error": f"{type(exc).__name__}: {exc}"[-1500:]}
        section["seconds"] = round(time.monotonic() - t0, 1)
        report[name] = section
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    report["meta"]["wall_s"] = time.monotonic() - start
    write(report, out)
    tier = report.get("tier") or {}
    failed = (tier.get("counts") or {}).get("failed", 0) or "error" in tier
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
