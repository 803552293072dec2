"""The MoE flags end to end (issue 32): the example trained with and without
`--moe-grouped-gemm --use-fused-moe-token-permute-and-unpermute`, same everything else.

    python benchmarks/bench_moe_flags.py [--rounds 2] [--iters 4] [--layers 2] [--seq 2048]
        [--variants off on grouped permute] [--concurrent] [--json PATH]

Shape from the issue: EP2 on 2 ranks, bf16, 8 experts top-2, hidden 512, expert FFN 1408,
sequence 2048, micro-batch 1, alltoall dispatcher. Each flag is meant to be chosen per shape
only where it is faster (npuspeed/ops/fused_choice.py), so "on" must not lose: the acceptance
is at least 0.95x the tokens/s of "off". Runs alternate (off, on, off, on, ...); per run the
median step (first iteration left out) of wall time and of CPU time summed over ranks (the
steadier one on a shared host); the ratio is of the medians over rounds. Prints the table and
the release it ran on; nothing is asserted (tests never time).

`--variants` adds each flag alone (`grouped`: --moe-grouped-gemm, `permute`: the fused
permute), every one against `off` from the same rounds. `--concurrent` starts a round's runs at
the same time instead of one after the other (on a host shared with other jobs, all variants
then see the same load; read the CPU-time ratio, which the other runs' time slices do not
inflate). `--json` writes what ran, the commit, the host and every run's raw numbers.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))

from launch import run_example  # noqa: E402

FLAGS = ["--moe-grouped-gemm", "--use-fused-moe-token-permute-and-unpermute"]
VARIANTS = {"off": [], "on": FLAGS, "grouped": FLAGS[:1], "permute": FLAGS[1:]}


def model_args(opts) -> list[str]:
    return ["--num-layers", str(opts.layers), "--hidden-size", "512", "--ffn-hidden-size", "1408",
            "--moe-ffn-hidden-size", "1408", "--num-attention-heads", "8", "--swiglu",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
            "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
            "--moe-token-dispatcher-type", "alltoall", "--bf16",
            "--seq-length", str(opts.seq), "--max-position-embeddings", str(opts.seq),
            "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", str(opts.iters),
            "--lr", "3e-4", "--use-cpu-initialization", "--log-interval", "1"]


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternating")
    parser.add_argument("--iters", type=int, default=4, help="iterations per run; the first is left out")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["off", "on"],
                        help="runs per round; off is always one (each ratio is against it)")
    parser.add_argument("--concurrent", action="store_true", help="a round's runs at the same time")
    parser.add_argument("--json", default=None, help="write the raw numbers here")
    opts = parser.parse_args()
    names = ["off"] + [v for v in opts.variants if v != "off"]
    base = model_args(opts)
    runs = {n: [] for n in names}
    raw = []
    lock = threading.Lock()

    def one(tmp, r, name):
        out = run_example(base + VARIANTS[name], Path(tmp), nproc=2, name=f"{name}{r}", timeout=3600)
        wall = out["median_step_ms"]
        cpu = sum(out["median_step_cpu_ms_per_rank"])
        paths = [ln.strip()[:300] for ln in out["log"].splitlines() if "grouped" in ln.lower() or "permute" in ln.lower()]
        with lock:
            runs[name].append((wall, cpu, out["losses"]))
            raw.append(dict(round=r, variant=name, flags=VARIANTS[name], median_step_ms=wall, median_step_cpu_ms_all_ranks=cpu,
                            step_ms=out["step_ms"], step_cpu_ms_rank0=out["step_cpu_ms"],
                            median_step_cpu_ms_per_rank=out["median_step_cpu_ms_per_rank"], losses=out["losses"],
                            path_lines=paths[:8]))
            print(f"round {r} {name:7s}: median step {wall:9.1f} ms wall, {cpu:9.1f} ms CPU (all ranks), "
                  f"losses {[round(x, 4) for x in out['losses']]}, step ms {[round(x) for x in out['step_ms']]}, "
                  f"step CPU ms (rank 0) {[round(x) for x in out['step_cpu_ms']]}", flush=True)
            if r == 0 and name != "off":  # which path each op took (the per-shape choice)
                print("\n".join(f"    {ln[:200]}" for ln in paths[:8]), flush=True)

    started = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(opts.rounds):
            if opts.concurrent:
                threads = [threading.Thread(target=one, args=(tmp, r, n)) for n in names]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                missing = [n for n in names if len(runs[n]) <= r]
                if missing:
                    raise SystemExit(f"bench_moe_flags: round {r}: {missing} failed (see above)")
            else:
                for name in names:
                    one(tmp, r, name)
    tokens = 2 * opts.seq  # global batch 2 x sequence per step
    med = {n: (statistics.median(w for w, _, _ in v), statistics.median(c for _, c, _ in v)) for n, v in runs.items()}
    from npuspeed.patching.versions import megatron_version

    print(f"\nmegatron-core {megatron_version()}, {opts.layers} layers, S {opts.seq}, {opts.rounds} rounds"
          f"{', concurrent' if opts.concurrent else ''}")
    print("| run | tokens/s (wall) | step CPU ms (all ranks) |\n|---|---|---|")
    for n in names:
        print(f"| {n} | {tokens / (med[n][0] / 1000):.1f} | {med[n][1]:.0f} |")
    ratios = {}
    for n in names[1:]:
        ratios[n] = dict(wall=med["off"][0] / med[n][0], cpu=med["off"][1] / med[n][1],
                         cpu_per_round=[o[1] / v[1] for o, v in zip(runs["off"], runs[n])])
        print(f"{n}/off tokens/s ratio: wall {ratios[n]['wall']:.3f}x, CPU {ratios[n]['cpu']:.3f}x "
              f"(CPU per round {[round(x, 3) for x in ratios[n]['cpu_per_round']]})")
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps(dict(
            command="python benchmarks/bench_moe_flags.py " + " ".join(sys.argv[1:]), commit=_commit(),
            started_utc=started.isoformat(timespec="seconds"),
            finished_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            host=dict(cpu=_cpu_model(), cores=os.cpu_count(), note="shared with other jobs"),
            megatron_core=str(megatron_version()), model_args=base, variants={n: VARIANTS[n] for n in names},
            concurrent=opts.concurrent, runs=raw, ratios_vs_off=ratios), indent=1) + "\n")
        print(f"wrote {opts.json}")

if __name__ == "__main__":
    main()
