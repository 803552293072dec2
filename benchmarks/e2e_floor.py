"""Step / compute floor at bench_e2e.py's end-to-end configuration (issue 48's CPU figure).

bench_e2e's model (Llama-style 8 layers, hidden 512, SwiGLU ffn 1408, 8 heads in 2 groups,
sequence 2048, bf16, micro-batch 1, global batch 2, TP2 + SP on 2 ranks on CPU), all off and all
on as bench_e2e runs them, each with its last iteration profiled (`--profile`), and the
compute floor of one rank (benchmarks/compute_floor.py, one thread as each rank has) timed
before and after the runs (a shared host's load drifts). The ratio is rank 0's median CPU time
per step over the floor's CPU time (`--clock cpu`): on a 2-core host shared with other work,
wall time measures the other work; the steps' wall times are kept beside it.

    python benchmarks/e2e_floor.py [--iters 6] [--layers 8] [--dtype bf16] [--out ...json]

`--layers` and `--dtype` are bench_e2e's own options (fp32 leaves out --reuse-fp32-param, as
bench_e2e does): on a host without AVX512-BF16, bf16 GEMMs are emulated and a step at 8 layers
takes minutes of CPU time.

Writes what was run, the commit, date, machine and the raw numbers.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tools"))

import bench_e2e  # noqa: E402
import torch  # noqa: E402
from launch import run_example  # noqa: E402

KEEP = ("median_step_ms", "step_ms", "median_step_cpu_ms", "step_cpu_ms", "tokens_per_s", "profile",
        "profiled_iterations", "model_flops_per_iteration", "losses", "attention_calls")


def floor(model: list[str], clock: str, tp: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "floor.json"
        subprocess.run([sys.executable, str(HERE / "compute_floor.py"), "--json", str(out), "--threads", "1",
                        "--world-size", str(tp), "--clock", clock, "--repeats", str(repeats), "--", *model], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--out", type=Path, default=HERE / "measured" / "e2e_floor_cpu.json")
    parser.add_argument("--floor-repeats", type=int, default=2, help="timings of each call in one floor")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    opts = parser.parse_args()
    e2e = argparse.Namespace(layers=opts.layers, seq=2048, iters=opts.iters, tp=2, dropout=0)
    fp32 = opts.dtype == "fp32"
    model = bench_e2e.model_args(e2e, "" if fp32 else "--bf16")
    configs = {"all off": [], "all on": [f for name, flags in bench_e2e.FEATURES.items() for f in flags
                                         if not (fp32 and name == "reuse-fp32-param")]}
    profile = ["--profile", "--profile-step-start", str(opts.iters - 1), "--profile-step-end", str(opts.iters)]
    floors, runs = [], {}

    def timed_floor():
        floors.append(floor(model + ["--use-flash-attn"], "cpu", e2e.tp, opts.floor_repeats))
        print(f"[e2e-floor] floor: CPU {floors[-1]['floor_ms']:.0f} ms", flush=True)

    timed_floor()  # before the runs and after them
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in configs.items():
            run = run_example(model + flags + profile, Path(tmp), nproc=e2e.tp, name=name.replace(" ", "_"),
                              timeout=3600)
            runs[name] = {k: run.get(k) for k in KEEP}
            print(f"[e2e-floor] {name}: median step {run['median_step_ms']:.0f} ms, CPU "
                  f"{run['median_step_cpu_ms']:.0f} ms", flush=True)
    timed_floor()
    cpu = [f["floor_ms"] for f in floors]
    ratios = {}
    for name, run in runs.items():
        steps = [t for i, t in enumerate(run["step_cpu_ms"]) if i > 0 and i + 1 not in run["profiled_iterations"]]
        ratios[name] = {"step_cpu_ms_measured": steps,
                        "step_over_floor_cpu": statistics.median(steps) / statistics.median(cpu),
                        "step_over_floor_cpu_range": [min(steps) / max(cpu), max(steps) / min(cpu)]}
        print(f"[e2e-floor] {name}: step / floor {ratios[name]['step_over_floor_cpu']:.2f}x in CPU time "
              f"(range {ratios[name]['step_over_floor_cpu_range'][0]:.2f}-"
              f"{ratios[name]['step_over_floor_cpu_range'][1]:.2f})", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                            text=True).stdout.strip()
    result = {"what": "step / compute floor at bench_e2e.py's configuration (issue 48)",
              "command": "python benchmarks/e2e_floor.py " + " ".join(sys.argv[1:]),
              "model_argv": model, "all_on_flags": configs["all on"], "profile_argv": profile,
              "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                          "cores": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__},
              "floor_ms_cpu": cpu, "ratios": ratios, "runs": runs, "floor_calls": floors[0]["calls"],
              "floor_first": {k: v for k, v in floors[0].items() if k != "calls"}}
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=1))
    print(f"[e2e-floor] wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
