"""`npuspeed plan` against measured runs: predicted vs measured peak memory (and step time).

Each configuration runs examples/pretrain_gpt.py under torchrun on CPU (gloo) and is planned
from the very same argument list; the example's `peak_mem_bytes` is the tracking
allocator's live-tensor peak, the largest over ranks. Prints a table (markdown with
--markdown), appends rows to benchmarks/results/plan_validate.csv.

Every configuration is a row: a run that fails (non-zero exit, a timeout, no summary or no
peak in it) or a configuration the planner refuses is a row marked failed with its reason, and
counts against the figure ("within X% in K of N, F failed"), so a broken configuration can never
make the planner look better by dropping out.

Two sets: `tuned` (CONFIGS, the configurations the planner was tuned on, about 20 min here) and
`untuned` (UNTUNED, combinations added in Nov 2026 after the planner's changes, none of them in
the tuned set: other hidden/ffn/layer counts, GQA groups, kv-channels, TP/PP/SP/CP/EP mixes,
recompute, swap, fused-CE, DualPipeV and MoE flags; 2 ranks at most: 14 min on the 2-core VM at load
8-28, its ranks' start-up most of it).

    python benchmarks/plan_validate.py                 # the tuned set
    python benchmarks/plan_validate.py --set untuned --json benchmarks/measured/cpu-plan-untuned-DATE.json
    python benchmarks/plan_validate.py --only tp2 pp2  # names containing these
    python benchmarks/plan_validate.py --speed         # also: calibrate each configuration
                                                       # (npuspeed plan --calibrate) and compare
                                                       # predicted with measured step time
"""
from __future__ import annotations

import argparse
import csv
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
import launch  # noqa: E402  (tools/launch.py: the one launcher of the tests and benchmarks)

BASE = ["--use-cpu-initialization", "--log-interval", "1", "--num-layers", "4", "--hidden-size", "256",
        "--num-attention-heads", "4", "--seq-length", "256", "--micro-batch-size", "2"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "704"]
FUSED = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb"]
NODROP = ["--attention-dropout", "0"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]

# (name, ranks, extra flags)
CONFIGS = [
    ("tp1 fp32", 1, []),
    ("tp1 bf16", 1, ["--bf16"]),
    ("tp2 fp32", 2, ["--tensor-model-parallel-size", "2"]),
    ("tp2 sp bf16", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16"]),
    ("pp2 fp32 m4", 2, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]),
    ("pp2 vpp2 bf16 m4", 2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                             "--global-batch-size", "8", "--bf16"]),
    ("dp2 fp32", 2, []),
    ("dp2 distopt fp32", 2, ["--use-distributed-optimizer"]),
    ("dp2 distopt bf16", 2, ["--use-distributed-optimizer", "--bf16"]),
    ("bf16 reuse-fp32", 1, ["--bf16", "--reuse-fp32-param"]),
    ("dp2 distopt bf16 reuse-fp32", 2, ["--use-distributed-optimizer", "--bf16", "--reuse-fp32-param"]),
    ("recompute-activation fp32", 1, ["--recompute-activation-function"]),
    ("recompute-activation 2 layers bf16", 1, ["--recompute-activation-function",
                                               "--recompute-activation-function-num-layers", "2", "--bf16"]),
    ("full recompute bf16", 1, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                "--recompute-num-layers", "1", "--bf16"]),
    ("selective recompute fp32", 1, ["--recompute-granularity", "selective"]),
    ("flash-attn fp32", 1, ["--use-flash-attn"] + NODROP),
    ("flash-attn bf16", 1, ["--use-flash-attn", "--bf16"] + NODROP),
    ("flash-attn fp32 with dropout", 1, ["--use-flash-attn"]),
    ("llama fp32", 1, LLAMA),
    ("llama bf16 fused ops + flash", 1, LLAMA + FUSED + ["--use-flash-attn", "--bf16"] + NODROP),
    ("llama tp2 sp bf16 recompute-activation", 2, LLAMA + ["--tensor-model-parallel-size", "2",
                                                           "--sequence-parallel", "--bf16",
                                                           "--recompute-activation-function"]),
    ("tp2 pp2 sp bf16 m4", 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                               "--sequence-parallel", "--bf16", "--global-batch-size", "8"]),
    ("pp2 dp2 distopt bf16 m2", 4, ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                                    "--bf16", "--global-batch-size", "8"]),
    ("seq 512 mbs 4 fp32", 1, ["--seq-length", "512", "--micro-batch-size", "4"]),
    ("seq 512 fp32 attention-dropout 0", 1, ["--seq-length", "512"] + NODROP),
    ("seq 512 fp32 attention-dropout 0 recompute-activation", 1, ["--seq-length", "512",
                                                                  "--recompute-activation-function"] + NODROP),
    ("selective recompute fp32 attention-dropout 0", 1, ["--recompute-granularity", "selective"] + NODROP),
    ("cp2 ring fp32", 2, ["--use-flash-attn", "--context-parallel-size", "2"]),
    ("cp2 ulysses bf16", 2, ["--use-flash-attn", "--context-parallel-size", "2", "--context-parallel-algo",
                             "ulysses_cp_algo", "--bf16"]),
    ("cp2 ring llama bf16 distopt seq 512", 2, LLAMA + ["--use-flash-attn", "--context-parallel-size", "2", "--bf16",
                                                        "--use-distributed-optimizer", "--seq-length", "512"]),
    ("cp4 hybrid bf16", 4, ["--use-flash-attn", "--context-parallel-size", "4", "--context-parallel-algo",
                            "hybrid_cp_algo", "--ulysses-degree-in-cp", "2", "--bf16"]),
    ("moe4 top2 fp32", 1, MOE),
    ("moe4 ep2 fp32", 2, MOE + ["--expert-model-parallel-size", "2"]),
    ("moe4 ep2 bf16 swiglu grouped-gemm", 2, MOE + ["--expert-model-parallel-size", "2", "--swiglu", "--bf16",
                                                    "--moe-grouped-gemm"]),
    ("moe4 ep2 bf16 distopt fused-permute", 2, MOE + ["--expert-model-parallel-size", "2", "--bf16",
                                                      "--use-distributed-optimizer",
                                                      "--use-fused-moe-token-permute-and-unpermute"]),
    ("moe4 tp2 sp tp-extend-ep bf16", 2, MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                "--moe-tp-extend-ep", "--bf16"]),
    ("moe4 ep2 a2a-overlap grouped-gemm swiglu bf16", 2, MOE + ["--expert-model-parallel-size", "2", "--swiglu",
                                                                "--moe-grouped-gemm", "--moe-alltoall-overlap-comm",
                                                                "--bf16"]),
    ("cp2 tp2 sp ring bf16", 4, ["--use-flash-attn", "--context-parallel-size", "2", "--tensor-model-parallel-size",
                                 "2", "--sequence-parallel", "--bf16"]),
]


# Configurations the planner was not tuned on (added 29 Nov 2026, after its last change): another
# base (3 layers, hidden 192, 6 heads of 32, S 128, micro-batch 4) and combinations absent from
# CONFIGS. Each is 2 ranks at most; all are planned without problems by the planner at the commit
# they were added (a refused one would still be a failed row, not a dropped one).
UNTUNED_BASE = ["--use-cpu-initialization", "--log-interval", "1", "--num-layers", "3", "--hidden-size", "192",
                "--num-attention-heads", "6", "--seq-length", "128", "--micro-batch-size", "4"]
RMS_ROPE = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear"]
MOE8 = ["--num-experts", "8", "--disable-bias-linear", "--expert-model-parallel-size", "2"]
UNTUNED = [
    ("gqa3 ffn512 dp2 bf16", 2, RMS_ROPE + ["--group-query-attention", "--num-query-groups", "3",
                                            "--ffn-hidden-size", "512", "--bf16"]),
    ("h320 heads8 gqa4 ffn896 tp2 sp selective fp32", 2, RMS_ROPE + [
        "--hidden-size", "320", "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4",
        "--ffn-hidden-size", "896", "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--recompute-granularity", "selective"]),
    ("l6 h128 pp2 m3 full-block-recompute bf16", 2, [
        "--num-layers", "6", "--hidden-size", "128", "--num-attention-heads", "4", "--pipeline-model-parallel-size",
        "2", "--global-batch-size", "12", "--recompute-granularity", "full", "--recompute-method", "block",
        "--recompute-num-layers", "2", "--bf16"]),
    ("l4 pp2 m2 qk-layernorm qkv-bias untied fp32", 2, [
        "--num-layers", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--qk-layernorm",
        "--add-qkv-bias", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]),
    ("kv48 tp2 recompute-norm recompute-activation fused-rmsnorm bf16", 2, RMS_ROPE + [
        "--kv-channels", "48", "--tensor-model-parallel-size", "2", "--recompute-norm",
        "--recompute-activation-function", "--use-fused-rmsnorm", "--bf16"]),
    # top 1 needs --moe-router-pre-softmax (megatron-core refuses it otherwise: a failed row in the first run)
    ("moe8 top1 ep2 moe-ffn128 bf16", 2, MOE8 + ["--moe-router-topk", "1", "--moe-router-pre-softmax",
                                                 "--moe-ffn-hidden-size", "128", "--bf16"]),
    ("moe8 top2 ep2 moe-ffn192 distopt grouped-gemm swiglu fp32", 2, MOE8 + [
        "--moe-router-topk", "2", "--moe-ffn-hidden-size", "192", "--use-distributed-optimizer", "--moe-grouped-gemm",
        "--swiglu"]),
    # DualPipeV (npuspeed's --schedules-method dualpipev: two chunks per rank in a V, untied embeddings)
    ("l4 pp2 dualpipev m4 untied fp32", 2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                                           "--num-layers-per-virtual-pipeline-stage", "1", "--schedules-method",
                                           "dualpipev", "--untie-embeddings-and-output-weights",
                                           "--global-batch-size", "16"]),
    ("dp2 swap-attention swap-optimizer fp32", 2, ["--swap-attention", "--swap-optimizer"]),
    ("cp2 ulysses gqa2 rope seq256 mbs2 bf16", 2, RMS_ROPE + [
        "--group-query-attention", "--num-query-groups", "2", "--use-flash-attn", "--context-parallel-size", "2",
        "--context-parallel-algo", "ulysses_cp_algo", "--seq-length", "256", "--micro-batch-size", "2", "--bf16"]),
    ("tp2 sp fused-linear-ce bf16", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                        "--use-fused-linear-cross-entropy", "--bf16"]),
    ("dp2 distopt grad-accum-fusion m2 fp32", 2, ["--use-distributed-optimizer", "--gradient-accumulation-fusion",
                                                  "--global-batch-size", "16"]),
    ("l5 h128 heads2 seq384 mbs1 fp32", 1, ["--num-layers", "5", "--hidden-size", "128", "--num-attention-heads",
                                            "2", "--seq-length", "384", "--micro-batch-size", "1"]),
]
SETS = {"tuned": (BASE, CONFIGS), "untuned": (UNTUNED_BASE, UNTUNED)}


def run_example(argv: list[str], nproc: int, iters: int, env: dict | None = None, timeout: int = 900) -> dict:
    """The example under torchrun through tools/launch.py (the launcher the tests share); a
    failed run is a result with its reason and log, so one bad configuration does not end the
    table. `--max-restarts 0` takes launch's own-session path: after a timeout every process the
    launch left behind is killed, not only torchrun."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            result = launch.run_example([*argv, "--train-iters", str(iters)], Path(tmp), nproc=nproc, env=env,
                                        timeout=timeout, torchrun_args=["--max-restarts", "0"])
        except subprocess.TimeoutExpired:
            return {"failed": True, "reason": f"timed out after {timeout} s", "log": ""}
        except AssertionError as exc:
            return {"failed": True, "reason": failure_reason(str(exc)), "log": str(exc)[-4000:]}
    if not result.get("peak_mem_bytes"):
        return {"failed": True, "reason": "the summary has no peak_mem_bytes", "log": result.get("log", "")[-4000:]}
    return result


def failure_reason(message: str) -> str:
    """One line for a failed launch (launch.run_example's "example failed (RC): ..." message):
    the exit status, or that the run exited 0 without a summary, and the last error-looking line."""
    import re

    code = re.match(r"example failed \((-?\d+)\)", message)
    rc = int(code.group(1)) if code else None
    head = "exited 0 but wrote no summary" if rc == 0 else f"exit status {rc}" if rc is not None else "failed"
    # the workers' own lines ("[rank0]: ValueError: ..."), not torchrun's summary of their failure
    lines = [re.sub(r"^\[(?:rank|default)\d+\]:\s*", "", ln).strip() for ln in message.splitlines()[1:]]
    lines = [ln for ln in lines if ln and "elastic" not in ln and "ChildFailedError" not in ln]
    raised = [ln for ln in lines if re.match(r"([\w.]*(Error|Exception)\b|npuspeed: error)", ln)]
    errors = raised or [ln for ln in lines if re.search(r"error|Error|Traceback|refus", ln)]
    last = (errors or lines or [""])[-1]
    return f"{head}: {last[:300]}" if last else head


def calibrate(argv: list[str], nproc: int, path: Path) -> dict:
    """`npuspeed plan --calibrate` for one configuration (its own flags and ranks), as a user runs it."""
    from npuspeed.plan.speed import load_profile

    proc = subprocess.run([sys.executable, "-m", "npuspeed.cli", "plan", "--calibrate", *argv, "--nproc-per-node",
                           str(nproc), "--profile", str(path)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise RuntimeError(f"calibration failed: {proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return load_profile(str(path))


def predict(argv: list[str], nproc: int, profile=None):
    from npuspeed.plan.planner import plan

    return plan([*argv, "--nproc-per-node", str(nproc)], profile=profile, with_removes=False)


def failed_row(name: str, nproc: int, extra: list[str], reason: str, t0: float) -> dict:
    return {"config": name, "ranks": nproc, "status": "failed", "reason": reason, "predicted_mib": None,
            "measured_mib": None, "error": None, "measured_step_ms": None, "measured_median_step_ms": None,
            "measured_optimizer_ms": None, "predicted_optimizer_ms": None, "predicted_step_ms": None,
            "predicted_median_step_ms": None, "load_avg_1m": os.getloadavg()[0], "flags": " ".join(extra),
            "wall_s": time.time() - t0, "step_error": None, "median_step_error": None}


def validate_one(name: str, nproc: int, extra: list[str], base: list[str], iters: int, *, measured=None,
                 profile=None, speed: bool = False, timeout: int = 900, runner=None, planner=None) -> dict:
    """One configuration's row: run it (or take `measured`), plan it, compare. Never raises for a
    failed run or a refused plan: those are rows with status "failed" and their reason.
    `runner`/`planner`: run_example/predict by default (a test passes fakes)."""
    runner = runner or run_example
    planner = planner or predict
    argv = base + extra
    t0 = time.time()
    if measured is None:
        measured = runner(argv, nproc, iters, timeout=timeout)
    if measured.get("failed"):
        print(f"{name}: run failed: {measured.get('reason', 'no reason given')}\n{measured.get('log', '')}",
              file=sys.stderr)
        return failed_row(name, nproc, extra, f"run: {measured.get('reason', 'failed')}", t0)
    own = profile
    try:
        if speed:
            with tempfile.TemporaryDirectory() as tmp:
                own = calibrate(argv, nproc, Path(tmp) / "profile.json")
        planned = planner(argv, nproc, own)
        # the same profile read at its median repeats (speed.py: the fastest are the default)
        median = planner(argv, nproc, {**own, "estimate": "median"}) if own else None
    except Exception as exc:  # noqa: BLE001  (the row says what the planner raised; the table goes on)
        return failed_row(name, nproc, extra, f"plan: {type(exc).__name__}: {exc}"[:400], t0)
    if planned.problems:
        return failed_row(name, nproc, extra, "plan: " + "; ".join(map(str, planned.problems))[:400], t0)
    pred, meas = planned.peak, measured["peak_mem_bytes"]
    row = {"config": name, "ranks": nproc, "status": "ok", "reason": "", "predicted_mib": pred / 2**20,
           "measured_mib": meas / 2**20, "error": pred / meas - 1.0,
           # the fastest step after the first: the one least disturbed by a shared host's other work
           "measured_step_ms": min(measured["step_ms"][1:]) if len(measured.get("step_ms") or []) > 1 else measured.get(
               "median_step_ms"),
           # the typical step (median after the first), what the median-repeat estimate predicts
           "measured_median_step_ms": measured.get("median_step_ms"),
           # the optimizer step apart, fastest after the first, against the default estimate's
           "measured_optimizer_ms": (min(measured["optimizer_step_ms"][1:])
                                     if len(measured.get("optimizer_step_ms") or []) > 1 else None),
           "predicted_optimizer_ms": planned.speed.optimizer_ms if planned.speed else None,
           "predicted_step_ms": planned.speed.step_ms if planned.speed else None,
           "predicted_median_step_ms": median.speed.step_ms if median and median.speed else None,
           "load_avg_1m": os.getloadavg()[0],
           "flags": " ".join(extra), "wall_s": time.time() - t0, "step_error": None,
           "median_step_error": None}
    if row["predicted_step_ms"] and row["measured_step_ms"]:
        row["step_error"] = row["predicted_step_ms"] / row["measured_step_ms"] - 1.0
        if row["predicted_median_step_ms"] and row["measured_median_step_ms"]:
            row["median_step_error"] = row["predicted_median_step_ms"] / row["measured_median_step_ms"] - 1.0
    return row


def line(row: dict) -> str:
    """The row as printed while the table runs."""
    if row["status"] != "ok":
        return f"{row['config']:45s} FAILED: {row['reason']}"
    step = ""
    if row["step_error"] is not None:
        step = f"  step {row['predicted_step_ms']:.0f} / {row['measured_step_ms']:.0f} ms {row['step_error']:+6.1%}"
        if row["median_step_error"] is not None:
            step += (f" (median-repeat estimate {row['predicted_median_step_ms']:.0f} / measured median "
                     f"{row['measured_median_step_ms']:.0f} ms {row['median_step_error']:+6.1%})")
        if row["measured_optimizer_ms"] and row["predicted_optimizer_ms"]:
            step += f"  optimizer {row['predicted_optimizer_ms']:.0f} / {row['measured_optimizer_ms']:.0f} ms"
        step += f"  load {row['load_avg_1m']:.2f}"
    return (f"{row['config']:45s} predicted {row['predicted_mib']:8.2f} MiB  measured {row['measured_mib']:8.2f} MiB  "
            f"{row['error']:+6.1%}{step}")


def summary(rows: list[dict], bound: float = 0.10) -> str:
    """The figure over every row: "within X% in K of N, F failed" (a failed row is one of the N
    and never within)."""
    ok = [r for r in rows if r["status"] == "ok"]
    failed = len(rows) - len(ok)
    worst = max((abs(r["error"]) for r in ok), default=None)
    within = sum(abs(r["error"]) <= bound for r in ok)
    text = (f"memory within {worst:.1%} in {len(ok)} of {len(rows)}" if worst is not None
            else f"memory measured in 0 of {len(rows)}")
    text += f"; within {bound:.0%} in {within} of {len(rows)}"
    return text + (f", {failed} failed" if failed else "")


def markdown(rows: list[dict]) -> str:
    out = ["| configuration | ranks | predicted MiB | measured MiB | error | predicted ms (fastest repeats) | "
           "fastest step ms | error | predicted ms (median repeats) | median step ms | error | load |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            out.append(f"| {r['config']} | {r['ranks']} | failed: {r['reason']} | | | | | | | | | "
                       f"{r['load_avg_1m']:.1f} |")
            continue
        ps, pm = r["predicted_step_ms"], r["predicted_median_step_ms"]
        step = f"{ps:.0f} | {r['measured_step_ms']:.0f} | {r['step_error']:+.1%}" if r["step_error"] is not None \
            else " | | "
        med = f"{pm:.0f} | {r['measured_median_step_ms']:.0f} | {r['median_step_error']:+.1%}" \
            if r["median_step_error"] is not None else " | | "
        out.append(f"| {r['config']} | {r['ranks']} | {r['predicted_mib']:.2f} | {r['measured_mib']:.2f} | "
                   f"{r['error']:+.1%} | {step} | {med} | {r['load_avg_1m']:.1f} |")
    return "\n".join(out)


def _git(*args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip()


def machine() -> dict:
    """What the numbers were measured on: CPU model, cores, load, versions."""
    model = platform.processor() or "unknown"
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                model = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    try:
        from importlib.metadata import version

        megatron = version("megatron-core")
    except Exception:  # noqa: BLE001
        megatron = "unknown"
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "megatron_core": megatron, "os": platform.platform()}


def result_file(rows: list[dict], set_name: str, base: list[str], iters: int, started: str, load_start: float,
                bound: float = 0.10) -> dict:
    """The benchmarks/measured/ file of a run (read by benchmarks/figures.py): every row, a failed
    one with its reason and None for its error (figures.py counts it against the figure)."""
    m = machine()
    planner_commit = _git("log", "-1", "--format=%h %cs", "--", "npuspeed/plan", "npuspeed/features")
    return {
        "what": (f"python benchmarks/plan_validate.py --set {set_name}: npuspeed plan's predicted peak memory against "
                 f"the example's measured peak (tracking allocator, largest over ranks), {len(rows)} configurations, "
                 f"{iters} iterations each, one at a time, CPU + gloo, memory only (no --speed: step time not "
                 f"compared); base: {' '.join(base)}"),
        "commit": _git("rev-parse", "--short", "HEAD") + f" (the planner's last change: {planner_commit})",
        "date": started[:10],
        "machine": (f"{m['cpu']}, {m['cores']} cores, 1-minute load {load_start:.1f} at the start (shared with "
                    f"other jobs; each row has its own), python {m['python']}, torch {m['torch']}, megatron-core "
                    f"{m['megatron_core']}"),
        "versions": m,
        "provenance": (f"measured by the command above, started {started} UTC; every configuration is a row, "
                       "a failed one (run or plan) with its reason; CPU only"),
        "raw": {"rows": rows, "memory_error_pct": [None if r["error"] is None else 100 * r["error"] for r in rows],
                "bound_pct": 100 * bound, "summary": summary(rows, bound)},
        "figures": {"memory_max_error": {"kind": "max_abs", "from": "memory_error_pct", "digits": 1, "unit": "%"},
                    "memory_within_10": {"kind": "count_within", "from": "memory_error_pct", "bound": 100 * bound},
                    "memory_bound": {"kind": "value", "from": "bound_pct", "digits": 0, "unit": "%"},
                    "memory_error_range": {"kind": "range", "from": "memory_error_pct", "digits": 1, "signed": True,
                                           "sep": " to ", "unit": "%"}},
    }


def main() -> int:
    import datetime
    import json

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", choices=sorted(SETS), default="tuned", help="which configurations (default: tuned)")
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--timeout", type=int, default=900, help="seconds one run may take before it is a failed row")
    p.add_argument("--profile", default=None, help="one calibration profile for every configuration's step time")
    p.add_argument("--speed", action="store_true", help="calibrate each configuration (its own profile) and "
                   "compare predicted with measured step time")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", default=None, help="also write the result file (benchmarks/measured/ form) here")
    p.add_argument("--replan", action="store_true",
                   help="run nothing: re-plan the configurations of the last rows in the CSV (e.g. with a "
                        "new --profile) against the measurements stored there")
    args = p.parse_args()
    profile = None
    if args.profile:
        from npuspeed.plan.speed import load_profile

        profile = load_profile(args.profile)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    load_start = os.getloadavg()[0]
    base, configs = SETS[args.set]
    rows = []
    stored = {}
    if args.replan:
        with open(ROOT / "benchmarks" / "results" / "plan_validate.csv") as fh:
            for row in csv.DictReader(fh):
                stored[row["config"]] = row
    for name, nproc, extra in configs:
        if args.only and not any(o in name for o in args.only):
            continue
        measured = None
        if args.replan:
            if name not in stored:
                continue
            row = stored[name]
            if row.get("status", "ok") != "ok":
                measured = {"failed": True, "reason": row.get("reason", "failed"), "log": ""}
            else:
                measured = {"peak_mem_bytes": float(row["measured_mib"]) * 2**20,
                            "median_step_ms": float(row["measured_step_ms"] or 0) or None}
        row = validate_one(name, nproc, extra, base, args.iters, measured=measured, profile=profile,
                           speed=args.speed, timeout=args.timeout)
        rows.append(row)
        print(line(row), flush=True)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ("plan_validate_replan.csv" if args.replan else "plan_validate.csv"), "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["config"])
        if fh.tell() == 0:
            w.writeheader()
        w.writerows(rows)
    if args.markdown:
        print("\n" + markdown(rows))
    failed = [r for r in rows if r["status"] != "ok"]
    worst = max((abs(r["error"]) for r in rows if r["status"] == "ok"), default=0.0)
    print(f"\n{len(rows)} configurations: {summary(rows)}")
    for r in failed:
        print(f"  failed: {r['config']}: {r['reason']}")
    for label, key in (("fastest step vs fastest-repeat estimate", "step_error"),
                       ("median step vs median-repeat estimate", "median_step_error")):
        steps = [abs(r[key]) for r in rows if r.get(key) is not None]
        if steps:
            print(f"{label}: largest error {max(steps):.1%}, {sum(s <= 0.25 for s in steps)} of {len(steps)} "
                  "within 25%")
    if args.json:
        Path(args.json).write_text(json.dumps(result_file(rows, args.set, base, args.iters, started, load_start),
                                              indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if worst <= 0.10 and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
