"""Each rank's pipeline bubble at PP 2, measured, against its schedule's formula: Megatron's
interleaved schedule (VPP 2; formula (PP-1)(F+B)) and DualPipeV (`--schedules-method dualpipev`;
formula (PP-1)(F&B+B-3W), W = 0), on gloo ranks of this host.

    python benchmarks/bench_pipeline_bubble.py [--ranks 2|4] [--iters 6] [--micro-batches 8] [--hidden 128 ...]

`--ranks 2`: PP 2 alone (one rank per core on a 2-core host: no oversubscription), MoE experts
local; the interleaved schedule as is and with `--overlap-p2p-comm` (its transfers posted ahead
and waited on later, so a rank is not held in lockstep with the other's op times). `--ranks 4`: PP 2 x EP 2 (oversubscribed on a small host), each schedule serial and with
`--moe-fb-overlap` (the interleaved one runs its extra micro-batch and pairs; DualPipeV's pairs
take turns). The example's `pipeline_bubble` (every rank): the time blocked in pipeline receives
a step, after the first iteration, beside the formula from the same rank's lone forward and
backward calls of one chunk and micro-batch (and its paired steps' time, F&B). Prints one row per
rank: the raw wait, then the terms that make it the formula's quantity (npuspeed/features/
pipeline/bubble/): less the transfers, plus the tail (waiting for the pipeline's last
op), less the stage imbalance; the waits by phase below. `--pin`: each rank on its own core.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


def model(a) -> list[str]:
    return ["--use-cpu-initialization", "--make-vocab-size-divisible-by", "1", "--log-interval", "100",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear",
            "--num-layers", "4", "--hidden-size", str(a.hidden), "--ffn-hidden-size", str(a.hidden),
            "--num-attention-heads", "4", "--seq-length", str(a.seq), "--num-experts", "4", "--moe-router-topk", "2",
            "--expert-model-parallel-size", str(a.ranks // 2), "--pipeline-model-parallel-size", "2",
            "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size", "1",
            "--untie-embeddings-and-output-weights",
            "--global-batch-size", str(a.ranks // 2 * a.micro_batches), "--train-iters", str(a.iters)]


def runs(a) -> list[tuple[str, list[str], str]]:
    """(name, flags, NPUSPEED_FB_OVERLAP_PATH) of each run."""
    dual = ["--schedules-method", "dualpipev"]
    if a.ranks == 2:
        return [("interleaved", [], ""), ("interleaved --overlap-p2p-comm", ["--overlap-p2p-comm"], ""),
                ("dualpipev", dual, "")]
    fb = ["--moe-fb-overlap"]
    return [("interleaved", fb, "serial"), ("interleaved + fb overlap", fb, "paired"),
            ("dualpipev", dual, ""), ("dualpipev + fb overlap", dual + fb, "paired")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, choices=[2, 4], default=2)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--micro-batches", type=int, default=8, help="per data-parallel rank")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--pin", action="store_true", help="each rank on one core (benchmarks/_pinned.py)")
    a = p.parse_args()
    from launch import free_port

    print(f"PP 2 x VPP 2 (EP {a.ranks // 2}), {a.ranks} ranks, {a.micro_batches} micro-batches a step, hidden "
          f"{a.hidden}, seq {a.seq}, {a.iters} iterations (first left out)")
    status = 0
    script = ROOT / "benchmarks" / "_pinned.py" if a.pin else ROOT / "examples" / "pretrain_gpt.py"
    for name, flags, path in runs(a):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "summary.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.ranks), "--master-addr",
                   "127.0.0.1", "--master-port", str(free_port()), str(script),
                   *model(a), *flags, "--summary-json", str(out)]
            env = dict(os.environ, OMP_NUM_THREADS="1", NPUSPEED_MEASURE_BUBBLE="1")  # measured without a flag too
            if path:
                env["NPUSPEED_FB_OVERLAP_PATH"] = path
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode:
                print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
                return proc.returncode
            summary = json.loads(out.read_text())
        rows = summary.get("pipeline_bubble") or []
        hidden = (summary.get("a2a_hidden_fraction") or {}).get("overall")
        print(f"\n{name} (all-to-all hidden per transfer: {hidden if hidden is None else round(hidden, 2)}; "
              f"median step {summary.get('median_step_ms', float('nan')):.0f} ms; formula "
              f"{rows[0]['formula'] if rows else '?'})")
        print(f"{'rank':>4} {'idle ms/step':>13} {'transfers':>10} {'tail':>7} {'imbalance':>10} {'bubble':>7} "
              f"{'F ms':>7} {'B ms':>7} "
              f"{'F&B ms':>7} {'formula ms':>11} {'idle/formula':>13} {'bubble/formula':>15}")
        for r in rows:
            ratio, adjusted = r["measured_over_formula"], r.get("bubble_over_formula")
            nan = float("nan")
            print(f"{r['rank']:>4} {r['idle_ms_per_step']:>13.1f} {r.get('transfer_ms_per_step', nan):>10.1f} "
                  f"{r.get('tail_ms_per_step', nan):>7.1f} {r.get('imbalance_ms_per_step', nan):>10.1f} "
                  f"{r.get('bubble_ms_per_step', nan):>7.1f} "
                  f"{r['forward_ms'] or nan:>7.1f} {r['backward_ms'] or nan:>7.1f} {r.get('pair_ms') or nan:>7.1f} "
                  f"{r['formula_ms'] or nan:>11.1f} {'n/a' if ratio is None else f'{ratio:.2f}':>13} "
                  f"{'n/a' if adjusted is None else f'{adjusted:.2f}':>15}")
        for r in rows:
            phases = r.get("idle_ms_per_step_by_phase") or {}
            print(f"  rank {r['rank']} waits by phase (ms/step): "
                  + ", ".join(f"{k.replace('_', '-')} {v:.1f}" for k, v in phases.items()))
        status = status or (0 if rows else 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
