"""Each rank's pipeline bubble with `--moe-fb-overlap` at PP 2 x VPP 2 x EP 2 (4 gloo ranks,
oversubscribed on a small host), measured against the interleaved schedule's formula, beside
Megatron's own interleaved schedule (the flag forced serial: no extra micro-batch, no pairs).

    python benchmarks/bench_pipeline_bubble.py [--iters 6] [--micro-batches 8] [--hidden 128 ...]

The example's `pipeline_bubble` (every rank): the time blocked in pipeline send/receive a step,
after the first iteration, beside (PP-1)(F+B) from the same rank's lone forward and backward
calls of one model chunk and micro-batch. Prints one row per rank and the ratio measured/formula
for each schedule.
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
            "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size", "1",
            "--global-batch-size", str(2 * a.micro_batches), "--train-iters", str(a.iters), "--moe-fb-overlap"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--micro-batches", type=int, default=8, help="per data-parallel rank")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=256)
    a = p.parse_args()
    from launch import free_port

    print(f"PP 2 x VPP 2 x EP 2, 4 ranks, {a.micro_batches} micro-batches a step, hidden {a.hidden}, seq {a.seq}, "
          f"{a.iters} iterations (first left out)")
    status = 0
    for path in ("serial", "paired"):  # Megatron's interleaved schedule (the flag forced serial), then paired
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "summary.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr",
                   "127.0.0.1", "--master-port", str(free_port()), str(ROOT / "examples" / "pretrain_gpt.py"),
                   *model(a), "--summary-json", str(out)]
            env = dict(os.environ, OMP_NUM_THREADS="1", NPUSPEED_FB_OVERLAP_PATH=path)
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode:
                print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
                return proc.returncode
            summary = json.loads(out.read_text())
        rows = summary.get("pipeline_bubble") or []
        hidden = (summary.get("a2a_hidden_fraction") or {}).get("overall")
        print(f"\n{path} (all-to-all hidden per transfer: {hidden if hidden is None else round(hidden, 2)}; "
              f"median step {summary.get('median_step_ms', float('nan')):.0f} ms)")
        print(f"{'rank':>4} {'idle ms/step':>13} {'F ms':>8} {'B ms':>8} {'formula ms':>11} {'measured/formula':>17}")
        for r in rows:
            ratio = r["measured_over_formula"]
            print(f"{r['rank']:>4} {r['idle_ms_per_step']:>13.1f} {r['forward_ms'] or float('nan'):>8.1f} "
                  f"{r['backward_ms'] or float('nan'):>8.1f} {r['formula_ms'] or float('nan'):>11.1f} "
                  f"{'n/a' if ratio is None else f'{ratio:.2f}':>17}")
        status = status or (0 if rows else 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
