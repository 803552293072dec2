"""The parts of the device report. Each takes the report's `Budget` and returns one JSON-able
section; a part that fails or runs out of time says so in its section (the report goes on)."""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from models import BASE_OF, E2E, RUNS, args_for  # noqa: F401 (RUNS: run.py's --runs choices)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from launch import run_example  # noqa: E402


class Budget:
    """Seconds left before the report's deadline; a part gets what is left, minus a reserve
    for writing the report."""

    def __init__(self, seconds: float, reserve: float = 15.0):
        self.deadline, self.reserve = time.monotonic() + seconds, reserve

    def left(self) -> float:
        return self.deadline - time.monotonic() - self.reserve


def _python(args: list[str], budget: Budget, cap: float, env: dict | None = None,
            log=None) -> subprocess.CompletedProcess:
    """`python args` in the checkout, within the budget; its output captured, or written as it
    runs into the open file `log`."""
    timeout = min(cap, budget.left())
    if timeout < 5:
        raise TimeoutError("no time left in the report's budget")
    output = {"capture_output": True} if log is None else {"stdout": log, "stderr": subprocess.STDOUT}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**os.environ, **(env or {})},
                          text=True, timeout=timeout, **output)


#: the tier's share of a report that runs other parts after it (alone it gets the whole budget):
#: on an H100 host with 16 cores and 10 processes it took 244 s (2026-11-26)
TIER_CAP_S = 300


def tier_workers() -> int:
    """pytest-xdist processes sharing the one device: its ~40 example runs are mostly start-up,
    so the host's cores bound them (10 on a 16-core host)."""
    return max(1, min(10, (os.cpu_count() or 2) - 6))


def tier(budget: Budget, out: Path, smoke: bool, cap: float = TIER_CAP_S) -> dict:
    """`pytest -m device tests/device` (what `make test-device` runs): counts and each failure.
    Unlike `make test-device` it compares no step times when xdist shares the device out. The
    log is written as it runs (-v), so a tier stopped at its cap still reports what finished."""
    xml, log = out / "tier.xml", out / "tier.log"
    workers, env = [], {"NPUSPEED_DEVICE": ""}
    if not smoke and importlib.util.find_spec("xdist") is not None:
        workers = ["-n", str(tier_workers()), "--dist", "loadfile"]
        env["NPUSPEED_DEVICE_TIER_SHARED"] = "1"
    xml.unlink(missing_ok=True)
    with open(log, "w") as fh:
        try:
            proc = _python(["-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "device", "tests/device",
                            f"--junitxml={xml}", *workers], budget, cap, env, log=fh)
        except subprocess.TimeoutExpired as exc:
            return {"error": f"the tier ran past {exc.timeout:.0f} s and was stopped (its log: tier.log); "
                             "what finished is below", **cases_from_log(log.read_text())}
    if not xml.is_file():
        return {"error": f"pytest exited {proc.returncode} without a report (tier.log)",
                **cases_from_log(log.read_text())}
    cases = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        state, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                state, why = ("skipped" if tag == "skipped" else "failed"), (node.get("message") or "")[:300]
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "state": state,
                      "seconds": float(case.get("time") or 0), "message": why})
    return {"returncode": proc.returncode, "counts": _counts(cases), "cases": cases}


#: `pytest -v` result lines: with xdist ("[gw0] [ 11%] PASSED path::case"), without it
#: ("path::case PASSED [ 11%]"), and the short summary ("FAILED path::case - message")
_XDIST = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED) (\S+::.*?)\s*$")
_PLAIN = re.compile(r"^(\S+::.*?) (PASSED|FAILED|ERROR|SKIPPED)(?:\s+\[\s*\d+%\])?\s*$")
_SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+::.*?)(?: - (.*))?$")
_HEADER = re.compile(r"^_{3,} (\S.*?) _{3,}$")
_STATE = {"PASSED": "passed", "FAILED": "failed", "ERROR": "failed", "SKIPPED": "skipped"}


def cases_from_log(text: str) -> dict:
    """Counts and cases from `pytest -v` lines (a tier stopped before its junit report, or the
    log of a tier run by hand): each case's state, failures with their short-summary message."""
    states, why, first_e, section = {}, {}, {}, None
    for line in text.splitlines():
        if m := _HEADER.match(line):
            section = m[1]
        elif section and line.startswith("E ") and section not in first_e:
            first_e[section] = line[1:].strip()
        if m := _SUMMARY.match(line):
            states.setdefault(m[2], "failed")
            why[m[2]] = (m[3] or "")[:300]
        elif m := _XDIST.match(line):
            states[m[2]] = _STATE[m[1]]
        elif m := _PLAIN.match(line):
            states[m[1]] = _STATE[m[2]]
    cases = [{"test": t, "state": st, "seconds": 0.0,
              "message": why.get(t) or first_e.get(t.split("::", 1)[-1], "")} for t, st in states.items()]
    return {"counts": _counts(cases), "cases": cases}


def tier_from_log(path: Path) -> dict:
    """The tier's section from the `pytest -v` log of a tier run in a call of its own."""
    return {**cases_from_log(path.read_text()), "from_log": path.name}


def _counts(cases: list[dict]) -> dict:
    return {s: sum(c["state"] == s for c in cases) for s in ("passed", "failed", "skipped")}


def _rows(csv_path: Path) -> list[dict]:
    with open(csv_path) as fh:
        rows = list(csv.DictReader(fh))
    for r in rows:
        r["extra"] = json.loads(r["extra"] or "{}")
    return rows


def _bench(name: str, args: list[str], budget: Budget, out: Path, cap: float) -> dict:
    """benchmarks/<name>.py with its harness rows written under out/<name>: the rows, or the error."""
    results = out / name
    proc = _python([f"benchmarks/{name}.py", *args, "--results-dir", str(results)], budget, cap=cap)
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    return {"rows": [r for p in results.glob("*.csv") for r in _rows(p)]}


def model_dims(smoke: bool) -> list[str]:
    """bench_fused_choice.py's model arguments from the training runs' own model (models.py):
    the kernel table times the shapes those runs hand the fused ops."""
    from models import LLAMA, SMOKE

    args = SMOKE if smoke else LLAMA

    def value(flag: str, default: str | None = None) -> str:
        return args[args.index(flag) + 1] if flag in args else default

    heads = value("--num-attention-heads")
    groups = value("--num-query-groups", heads) if "--group-query-attention" in args else heads
    return ["--hidden", value("--hidden-size"), "--ffn", value("--ffn-hidden-size"), "--heads", heads,
            "--groups", groups, "--seq", value("--seq-length"), "--micro-batch", value("--micro-batch-size", "1")]


def fused_ops(budget: Budget, out: Path, smoke: bool) -> dict:
    """bench_fused_choice.py: the fused ops' kernel table at the training runs' per-rank shapes,
    bf16 (their dtype): every candidate the flags choose among (Megatron's path, npuspeed's
    Triton or C++ kernel, torch.compile, Liger-Kernel where installed, ...) timed by the flags'
    own chooser, with its pick; the same measurement the flags make in the runs, so the table
    and the flags' choice cannot disagree."""
    result = out / "fused_ops.json"
    result.unlink(missing_ok=True)
    proc = _python(["benchmarks/bench_fused_choice.py", *model_dims(smoke), "--dtypes", "bf16", "--json", str(result)],
                   budget, cap=240)
    (out / "bench_fused_choice.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode or not result.is_file():
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    return {"table": json.loads(result.read_text())}


#: bench_triton_ops.py's cases that no flag's chooser times (those are in fused_ops' table)
TRITON_ONLY = "add_rmsnorm,moe"


def triton_ops(budget: Budget, out: Path, smoke: bool) -> dict:
    """bench_triton_ops.py on the kernels the fused-op table does not time: the residual-add
    RMSNorm (no flag runs it yet) and MoE permute/unpermute, each against Megatron's default.
    A case that fails is reported with its error and the others go on. Accelerators only."""
    if smoke:
        return {"skipped": "the Triton kernels are timed on an accelerator only"}
    section = _bench("bench_triton_ops", ["--repeat", "5", "--iters", "10", "--dtypes", "bf16", "--ops", TRITON_ONLY],
                     budget, out, cap=150)
    failures = out / "bench_triton_ops" / "failures.json"
    if failures.is_file():
        section["failures"] = json.loads(failures.read_text())
    return section


KEEP = ("losses", "tokens_per_s", "median_step_ms", "mean_step_ms", "peak_mem_bytes", "forward_backward_peak_bytes",
        "optimizer_step_peak_bytes", "weight_bytes", "tflops_per_s_per_rank", "mfu", "device_peak_tflops",
        "device", "npuspeed_counters", "attention_calls", "param_devices", "batch_devices", "step_ms",
        "profile", "profiled_iterations", "first_iteration")


def training_runs(budget: Budget, out: Path, smoke: bool, only=None) -> dict:
    """The example's runs of models.RUNS (those named in `only`, when given), in order, each as
    far as the budget goes."""
    runs, tmp = {}, out / "runs"
    tmp.mkdir(exist_ok=True)
    for name, run in RUNS.items():
        if only and name not in only:
            continue
        timeout = min(600.0, budget.left())
        if timeout < 30:
            runs[name] = {"error": "not run: the report's time budget was spent"}
            continue
        try:
            summary = run_example(args_for(run, smoke), tmp, name=name.replace(" ", "_"), env=dict(run.env),
                                  timeout=int(timeout))
            runs[name] = {k: summary.get(k) for k in KEEP}
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            runs[name] = {"error": str(exc)[-1500:]}
    return {"runs": runs, "base_of": BASE_OF, "e2e": list(E2E),
            "flags": {name: list(run.flags) for name, run in RUNS.items()}}


def codec(budget: Budget, out: Path, smoke: bool, params: int) -> dict:
    """--reuse-fp32-param's codec alone at the model's parameter count (merge + split of every
    master, as one step does), with the implementation the device picks."""
    if params <= 0:
        return {"error": "no parameter count: the flash-attn run did not finish"}
    result = out / "codec.json"
    proc = _python(["benchmarks/bench_reuse_fp32_param.py", "--codec-only", str(params), "--json", str(result)],
                   budget, cap=120)
    (out / "codec.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode or not result.exists():
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    return {"params": params, "timings": json.loads(result.read_text())}
