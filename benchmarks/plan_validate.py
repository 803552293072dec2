"""`npuspeed plan` against measured runs: predicted vs measured peak memory (and step time).

Each configuration runs examples/pretrain_gpt.py under torchrun on CPU (gloo) and is planned
from the very same argument list; the example's `peak_mem_bytes` is the tracking
allocator's live-tensor peak, the largest over ranks. Prints a table (markdown with
--markdown), appends rows to benchmarks/results/plan_validate.csv.

    python benchmarks/plan_validate.py                 # every configuration (about 20 min here)
    python benchmarks/plan_validate.py --only tp2 pp2  # names containing these
    python benchmarks/plan_validate.py --speed         # also: calibrate each configuration
                                                       # (npuspeed plan --calibrate) and compare
                                                       # predicted with measured step time
"""
from __future__ import annotations

import argparse
import csv
import os
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


def run_example(argv: list[str], nproc: int, iters: int, env: dict | None = None, timeout: int = 900) -> dict:
    """The example under torchrun through tools/launch.py (the launcher the tests share); a
    failed run is a result with its log, so one bad configuration does not end the table."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return launch.run_example([*argv, "--train-iters", str(iters)], Path(tmp), nproc=nproc, env=env,
                                      timeout=timeout)
        except AssertionError as exc:
            return {"failed": True, "log": str(exc)[-4000:]}


def calibrate(argv: list[str], nproc: int, path: Path) -> dict:
    """`npuspeed plan --calibrate` for one configuration (its own flags and ranks), as a user runs it."""
    import subprocess

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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--profile", default=None, help="one calibration profile for every configuration's step time")
    p.add_argument("--speed", action="store_true", help="calibrate each configuration (its own profile) and "
                   "compare predicted with measured step time")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--replan", action="store_true",
                   help="run nothing: re-plan the configurations of the last rows in the CSV (e.g. with a "
                        "new --profile) against the measurements stored there")
    args = p.parse_args()
    profile = None
    if args.profile:
        from npuspeed.plan.speed import load_profile

        profile = load_profile(args.profile)
    rows = []
    stored = {}
    if args.replan:
        with open(ROOT / "benchmarks" / "results" / "plan_validate.csv") as fh:
            for row in csv.DictReader(fh):
                stored[row["config"]] = row
    for name, nproc, extra in CONFIGS:
        if args.only and not any(o in name for o in args.only):
            continue
        argv = BASE + extra
        t0 = time.time()
        if args.replan:
            if name not in stored:
                continue
            row = stored[name]
            measured = {"peak_mem_bytes": float(row["measured_mib"]) * 2**20,
                        "median_step_ms": float(row["measured_step_ms"])}
        else:
            measured = run_example(argv, nproc, args.iters)
        own = profile
        if args.speed:
            with tempfile.TemporaryDirectory() as tmp:
                own = calibrate(argv, nproc, Path(tmp) / "profile.json")
        planned = predict(argv, nproc, own)
        # the same profile read at its median repeats (speed.py: the fastest are the default)
        median = predict(argv, nproc, {**own, "estimate": "median"}) if own else None
        if measured.get("failed"):
            print(f"{name}: run failed\n{measured['log']}", file=sys.stderr)
            continue
        pred, meas = planned.peak, measured["peak_mem_bytes"]
        row = {"config": name, "ranks": nproc, "predicted_mib": pred / 2**20, "measured_mib": meas / 2**20,
               "error": pred / meas - 1.0,
               # the fastest step after the first: the one least disturbed by a shared host's other work
               "measured_step_ms": min(measured["step_ms"][1:]) if measured.get("step_ms") else measured.get(
                   "median_step_ms"),
               # the typical step (median after the first), what the median-repeat estimate predicts
               "measured_median_step_ms": measured.get("median_step_ms"),
               # the optimizer step apart, fastest after the first, against the default estimate's
               "measured_optimizer_ms": (min(measured["optimizer_step_ms"][1:])
                                         if len(measured.get("optimizer_step_ms", [])) > 1 else None),
               "predicted_optimizer_ms": planned.speed.optimizer_ms if planned.speed else None,
               "predicted_step_ms": planned.speed.step_ms if planned.speed else None,
               "predicted_median_step_ms": median.speed.step_ms if median and median.speed else None,
               "load_avg_1m": os.getloadavg()[0],
               "flags": " ".join(extra), "wall_s": time.time() - t0, "step_error": None,
               "median_step_error": None}
        rows.append(row)
        step = ""
        if row["predicted_step_ms"]:
            row["step_error"] = row["predicted_step_ms"] / row["measured_step_ms"] - 1.0
            step = f"  step {row['predicted_step_ms']:.0f} / {row['measured_step_ms']:.0f} ms {row['step_error']:+6.1%}"
            if row["predicted_median_step_ms"]:
                row["median_step_error"] = row["predicted_median_step_ms"] / row["measured_median_step_ms"] - 1.0
                step += (f" (median-repeat estimate {row['predicted_median_step_ms']:.0f} / measured median "
                         f"{row['measured_median_step_ms']:.0f} ms {row['median_step_error']:+6.1%})")
            if row["measured_optimizer_ms"]:
                step += f"  optimizer {row['predicted_optimizer_ms']:.0f} / {row['measured_optimizer_ms']:.0f} ms"
            step += f"  load {row['load_avg_1m']:.2f}"
        print(f"{name:45s} predicted {row['predicted_mib']:8.2f} MiB  measured {row['measured_mib']:8.2f} MiB  "
              f"{row['error']:+6.1%}{step}", flush=True)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ("plan_validate_replan.csv" if args.replan else "plan_validate.csv"), "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["config"])
        if fh.tell() == 0:
            w.writeheader()
        w.writerows(rows)
    if args.markdown:
        print("\n| configuration | ranks | predicted MiB | measured MiB | error | predicted ms (fastest repeats) | "
              "fastest step ms | error | predicted ms (median repeats) | median step ms | error | load |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            ps, pm = r["predicted_step_ms"], r["predicted_median_step_ms"]
            step = f"{ps:.0f} | {r['measured_step_ms']:.0f} | {r['step_error']:+.1%}" if ps else " | | "
            med = f"{pm:.0f} | {r['measured_median_step_ms']:.0f} | {r['median_step_error']:+.1%}" if pm else " | | "
            print(f"| {r['config']} | {r['ranks']} | {r['predicted_mib']:.2f} | {r['measured_mib']:.2f} | "
                  f"{r['error']:+.1%} | {step} | {med} | {r['load_avg_1m']:.1f} |")
    worst = max((abs(r["error"]) for r in rows), default=0.0)
    print(f"\n{len(rows)} configurations, largest memory error {worst:.1%}")
    for label, key in (("fastest step vs fastest-repeat estimate", "step_error"),
                       ("median step vs median-repeat estimate", "median_step_error")):
        steps = [abs(r[key]) for r in rows if r.get(key) is not None]
        if steps:
            print(f"{label}: largest error {max(steps):.1%}, {sum(s <= 0.25 for s in steps)} of {len(steps)} "
                  "within 25%")
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
