"""benchmarks/plan_validate.py reports every configuration: a run that fails (non-zero exit, a
timeout, no summary, no peak in it) or a plan the planner refuses is a row marked failed with its
reason, counted against the figure ("K of N, F failed"), never dropped. No training here: fake
runners, and one real torchrun of a script that exits at once."""
from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pv = _load("plan_validate", ROOT / "benchmarks" / "plan_validate.py")
figures = _load("plan_validate_figures", ROOT / "benchmarks" / "figures.py")

MIB = 2**20


class _Planned:
    """What predict() returns, as far as validate_one reads it."""

    def __init__(self, peak: int, problems=()):
        self.peak, self.problems, self.speed = peak, list(problems), None


def _planner(peak_mib: float, problems=()):
    calls = []

    def planner(argv, nproc, profile=None):
        calls.append(argv)
        return _Planned(int(peak_mib * MIB), problems)

    planner.calls = calls
    return planner


def _ok(peak_mib: float):
    return lambda argv, nproc, iters, timeout=900: {"peak_mem_bytes": peak_mib * MIB, "step_ms": [3.0, 2.0],
                                                    "median_step_ms": 2.0}


def _rows(runs: dict):
    """One validate_one row per name, with the runner given for it (planner: 100 MiB)."""
    return [pv.validate_one(name, 2, [], ["--num-layers", "2"], 2, runner=runner, planner=_planner(100))
            for name, runner in runs.items()]


def test_a_failed_run_is_a_failed_row_with_its_reason():
    failed = lambda argv, nproc, iters, timeout=900: {"failed": True, "reason": "exit status 1: boom", "log": ""}
    row = pv.validate_one("broken", 2, ["--x"], ["--num-layers", "2"], 2, runner=failed, planner=_planner(100))
    assert row["status"] == "failed" and row["reason"] == "run: exit status 1: boom"
    assert row["error"] is None and row["config"] == "broken" and row["flags"] == "--x"


def test_failed_rows_count_against_the_figure():
    rows = _rows({"a": _ok(104), "b": _ok(80),
                  "c": lambda argv, nproc, iters, timeout=900: {"failed": True, "reason": "timed out after 1 s"}})
    assert [r["status"] for r in rows] == ["ok", "ok", "failed"]
    assert pv.summary(rows) == "memory within 25.0% in 2 of 3; within 10% in 1 of 3, 1 failed"
    data = pv.result_file(rows, "untuned", ["--num-layers", "2"], 2, "2026-11-29 12:00", 1.0)
    assert data["raw"]["memory_error_pct"][2] is None
    assert figures.render(data, "memory_within_10") == "1 of 3, 1 failed"
    assert figures.render(data, "memory_max_error") == "25.0%"
    assert not [k for k in figures.REQUIRED if not data.get(k)]


def test_a_refused_or_raising_plan_is_a_failed_row():
    refused = pv.validate_one("refused", 1, [], [], 2, runner=_ok(100),
                              planner=_planner(0, ["not modeled: --moe-shared-expert-intermediate-size"]))
    assert refused["status"] == "failed" and "not modeled" in refused["reason"]

    def raising(argv, nproc, profile=None):
        raise ValueError("bad flag")

    raised = pv.validate_one("raised", 1, [], [], 2, runner=_ok(100), planner=raising)
    assert raised["status"] == "failed" and raised["reason"] == "plan: ValueError: bad flag"


@pytest.mark.parametrize("raise_, reason", [
    (subprocess.TimeoutExpired(["torchrun"], 5), "timed out after 5 s"),
    (AssertionError("example failed (0): torchrun ...\nall done"), "exited 0 but wrote no summary: all done"),
    (AssertionError("example failed (2): torchrun ...\nloading\nnpuspeed: error: --foo: unknown flag\nexit"),
     "exit status 2: npuspeed: error: --foo: unknown flag"),
])
def test_run_example_turns_each_failure_into_a_reason(monkeypatch, raise_, reason):
    def launch(*args, **kwargs):
        raise raise_

    monkeypatch.setattr(pv.launch, "run_example", launch)
    result = pv.run_example(["--num-layers", "2"], 2, 2, timeout=5)
    assert result["failed"] and result["reason"] == reason


def test_a_summary_without_a_peak_is_a_failure(monkeypatch):
    monkeypatch.setattr(pv.launch, "run_example", lambda *a, **k: {"log": "ran", "step_ms": [1.0]})
    assert pv.run_example([], 1, 2)["reason"] == "the summary has no peak_mem_bytes"


def test_a_configuration_that_cannot_start_is_reported(monkeypatch, tmp_path):
    """A real torchrun launch (through tools/launch.py, as the benchmark runs it) of a script that
    exits 3 at once: the row is failed with the exit status, and the planner is not consulted."""
    script = tmp_path / "cannot_start.py"
    script.write_text("import sys\nprint('npuspeed: error: cannot start here', file=sys.stderr)\nsys.exit(3)\n")
    monkeypatch.setattr(pv.launch, "EXAMPLE", script)
    planner = _planner(100)
    row = pv.validate_one("cannot start", 1, [], [], 2, runner=lambda *a, **k: pv.run_example(*a, **k),
                          planner=planner, timeout=120)
    assert row["status"] == "failed", row
    # torchrun exits 1 for a failed worker; the reason is the worker's own line, not torchrun's summary
    assert row["reason"] == "run: exit status 1: npuspeed: error: cannot start here", row
    assert planner.calls == []
