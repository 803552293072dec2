"""MoE all-to-all hidden behind another micro-batch (`--moe-fb-overlap`) against the same run
without it, and against the chunked overlap (`--moe-alltoall-overlap-comm`): the example,
EP2 on 2 gloo ranks (real all-to-alls over loopback), 4 micro-batches a step.

    python benchmarks/bench_moe_fb_overlap.py [--rounds 3] [--hidden 512 --seq 1024 ...]

Runs, interleaved round by round: Megatron's MoE layer (no flag); --moe-fb-overlap forced serial
(NPUSPEED_FB_OVERLAP_PATH=serial: the same transfers on the clock, none hidden: what the
all-to-alls cost a step); forced paired; forced paired with the experts' dW kept joined with dX
(NPUSPEED_FB_OVERLAP_WGRAD=joined: not inside the dispatch gradient's all-to-all); auto (what a user gets: the step trial picks); the
chunked overlap, forced and as its own step trial picks. Prints per configuration the median step, tokens/s against Megatron's, the
all-to-all share of the serial step, and the hidden share two ways: per transfer (in flight -
waited over in flight: a2a_hidden_fraction, per phase) and per step (the serial step's all-to-all
time the compute no longer waits for: 1 - waited / serial in flight).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

RUNS = {  # name -> (flags, environment)
    "megatron": ([], {}),
    "fb serial": (["--moe-fb-overlap"], {"NPUSPEED_FB_OVERLAP_PATH": "serial"}),
    "fb paired": (["--moe-fb-overlap"], {"NPUSPEED_FB_OVERLAP_PATH": "paired"}),
    "fb joined": (["--moe-fb-overlap"], {"NPUSPEED_FB_OVERLAP_PATH": "paired", "NPUSPEED_FB_OVERLAP_WGRAD": "joined"}),
    "fb auto": (["--moe-fb-overlap"], {}),
    "chunked": (["--moe-alltoall-overlap-comm"], {"NPUSPEED_A2A_OVERLAP_PATH": "chunked"}),
    "chunk auto": (["--moe-alltoall-overlap-comm"], {}),
}


def model(a) -> list[str]:
    args = ["--use-cpu-initialization", "--make-vocab-size-divisible-by", "1", "--log-interval", "100",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear",
            "--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--ffn-hidden-size", str(a.ffn),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq), "--num-experts", str(a.experts),
            "--moe-router-topk", str(a.topk), "--expert-model-parallel-size", "2", "--micro-batch-size", str(a.mbs),
            "--global-batch-size", str(2 * a.mbs * a.micro_batches), "--train-iters", str(a.iters)]
    if a.shared:
        args += ["--moe-shared-expert-intermediate-size", str(a.shared)]
    return args + (["--bf16"] if a.bf16 else [])


def run(name: str, a, tmp: Path) -> dict:
    from launch import free_port

    flags, env = RUNS[name]
    out = tmp / f"{name.replace(' ', '_')}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(ROOT / "examples" / "pretrain_gpt.py"), *model(a), *flags,
           "--summary-json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", **env), capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(out.read_text())


def per_step(summary: dict, phases=None) -> tuple[float, float]:
    """(in flight, waited) ms a step, summed over the phases named (all but serial by default)."""
    rows = (summary.get("a2a_hidden_fraction") or {}).get("per_phase", {})
    rows = {k: v for k, v in rows.items() if (k in phases if phases else k != "serial")}
    steps = max(summary["iterations"] - 1, 1)  # the clock leaves the first iteration out
    return (sum(r["in_flight_ms"] for r in rows.values()) / steps, sum(r["waited_ms"] for r in rows.values()) / steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("layers", 2), ("hidden", 512), ("ffn", 256), ("heads", 8), ("seq", 1024),
                          ("experts", 4), ("topk", 2), ("shared", 256), ("micro-batches", 4), ("mbs", 1), ("iters", 8),
                          ("rounds", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--only", nargs="*", default=list(RUNS))
    a = p.parse_args()
    results: dict[str, list[dict]] = {n: [] for n in a.only}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name in a.only:
                results[name].append(run(name, a, Path(tmp)))
                print(f"round {r + 1} {name}: {results[name][-1]['median_step_ms']:.0f} ms", flush=True)
    step = {n: statistics.median(s["median_step_ms"] for s in runs) for n, runs in results.items()}
    base = step.get("megatron")
    serial_a2a = statistics.median(per_step(s, ("serial",))[0] for s in results["fb serial"]) \
        if "fb serial" in results else None
    print(f"\nconfiguration: {' '.join(model(a))}")
    if serial_a2a and "fb serial" in step:
        print(f"all-to-all without overlap: {serial_a2a:.0f} ms of a {step['fb serial']:.0f} ms step "
              f"({serial_a2a / step['fb serial']:.0%})")
    print(f"{'run':<10} {'step ms':>8} {'vs megatron':>11} {'hidden/transfer':>15} {'warm_up':>7} {'steady':>6} "
          f"{'cool_down':>9} {'layer':>5} {'hidden/step':>11}")
    for name, runs in results.items():
        fracs = [s.get("a2a_hidden_fraction") or {} for s in runs]
        med = lambda key: (statistics.median(f[key] for f in fracs if f.get(key) is not None)  # noqa: E731
                           if any(f.get(key) is not None for f in fracs) else None)
        waited = statistics.median(per_step(s)[1] for s in runs)
        # per step only where every step took the overlap (an auto run's Megatron steps leave no transfers on the clock)
        saved = (1 - waited / serial_a2a) if serial_a2a and name in ("fb paired", "fb joined", "chunked") else None
        cells = [f"{v:.2f}" if v is not None else "-" for v in
                 (med("overall"), med("warm_up"), med("steady"), med("cool_down"), med("layer"), saved)]
        ratio = f"{base / step[name]:.3f}x" if base else "-"
        print(f"{name:<10} {step[name]:>8.0f} {ratio:>11} {cells[0]:>15} {cells[1]:>7} {cells[2]:>6} {cells[3]:>9} "
              f"{cells[4]:>5} {cells[5]:>11}")


if __name__ == "__main__":
    main()
