"""The device report's "why" parts: the compute floor of the report's step and the torchtitan
anchor, and the Markdown of the profiled steps, the floor and the anchor.

The floor (benchmarks/compute_floor.py) times every GEMM and attention call of one step of
the flash-attention run at the report's model alone on the device; the e2e table divides each
run's median step by it. The profiles come with the training runs themselves (the example's
`--profile` on their last iteration: models.PROFILED). torchtitan is the anchor a single-GPU
user would pick instead; this part says whether it can run here, and why not where it cannot.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from models import RUNS, args_for
from parts import Budget, _python

PARTS = ("floor", "torchtitan")
CATEGORY_TITLES = (("gemm", "GEMM"), ("attention", "attention"), ("norm", "norm"), ("elementwise", "elementwise"),
                   ("memcpy", "copies"), ("optimizer", "optimizer"), ("communication", "comm"), ("idle", "idle"))


def model_args(smoke: bool) -> list[str]:
    """The flash-attention run's model and batch, without its profiling flags."""
    argv = args_for(RUNS["flash-attn"], smoke)
    return argv[:argv.index("--profile")] if "--profile" in argv else argv


def floor(budget: Budget, out: Path, smoke: bool) -> dict:
    """benchmarks/compute_floor.py at the flash-attention run's model and batch, one rank. On a
    host (--smoke) with one thread, as the launcher gives each rank; on a device ~30 s (an
    estimate: 16 distinct calls x 18 timed, plus the imports), capped at 150 s."""
    result = out / "floor.json"
    result.unlink(missing_ok=True)
    host = ["--threads", "1", "--repeats", "2"] if smoke else []  # --smoke: its code, not its figure
    proc = _python(["benchmarks/compute_floor.py", "--json", str(result), *host, "--", *model_args(smoke)],
                   budget, cap=300 if smoke else 150)
    (out / "floor.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode or not result.exists():
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    return json.loads(result.read_text())


#: what torchtitan 0.3.0's wheel needs besides torch (its METADATA's Requires-Dist, as modules)
TITAN_NEEDS = ("torchtitan", "torchdata", "torch_checkpointing", "spmd_types", "datasets", "tokenizers", "tyro",
               "tensorboard", "wandb", "safetensors", "einops")


def torchtitan(budget: Budget, out: Path, smoke: bool) -> dict:
    """The single-GPU anchor: torchtitan 0.3.0 on the report's model shape, where it can run.
    It says what is missing when it cannot: the package or its dependencies (the device machine
    is offline: everything must come as carried wheels), and its data. torchtitan's configs
    read their tokenizer and data set from its repository's tests/assets (not in the wheel) or
    stream C4 from the Hugging Face hub, which an offline machine cannot reach; running it on a
    made-up data set at this shape is not written yet (a follow-up), so this part never runs a
    step and never reports a figure it did not measure."""
    missing = [m for m in TITAN_NEEDS if importlib.util.find_spec(m) is None]
    why = []
    if missing:
        why.append(f"not importable here: {', '.join(missing)} (carry torchtitan 0.3.0 and its dependencies "
                   "as wheels in .whl/; the device machine is offline)")
    why.append("its configs take their tokenizer and data from torchtitan's repository (tests/assets: not in "
               "the wheel) or stream C4 from the Hugging Face hub (offline here); a synthetic-data run at the "
               "report's shape is not written yet")
    return {"ran": False, "missing": missing, "why": "; ".join(why)}


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def profile_lines(report: dict) -> list[str]:
    """Per profiled run: the step's time by category and its 15 most expensive kernels."""
    runs = ((report.get("training") or {}).get("runs") or {})
    profiled = {name: run["profile"] for name, run in runs.items() if isinstance(run, dict) and run.get("profile")}
    if not profiled:
        return []
    head = " | ".join(t for _, t in CATEGORY_TITLES)
    out = ["", "**Where a step goes** (torch.profiler on one step after warm-up, `--profile`; share of the step's "
           "wall time; idle: no kernel running on the device (on a host: outside any operator)):", "",
           f"| run | step ms | {head} |", "|---" * (len(CATEGORY_TITLES) + 2) + "|"]
    for name, p in profiled.items():
        out.append(f"| {name} | {p['step_ms']:.1f} | " + " | ".join(_pct(p["share"].get(c)) for c, _ in CATEGORY_TITLES)
                   + " |")
    for name, p in profiled.items():
        out += ["", f"15 most expensive kernels of `{name}` ({p['mode']}, iteration {p['iterations'][1]}):", "",
                "| kernel | category | ms | calls | share |", "|---|---|---|---|---|"]
        for k in p["top"]:
            out.append(f"| `{k['name'][:90]}` | {k['category']} | {k['ms']:.2f} | {k['calls']:g} | {k['share']:.1%} |")
    return out


def _tflops(x: float) -> str:
    """One decimal, as the e2e table; a host's fraction of a TFLOP/s in three digits."""
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def floor_ms(report: dict) -> float | None:
    f = report.get("floor") or {}
    return f.get("floor_ms") if "error" not in f else None


def floor_lines(report: dict) -> list[str]:
    f = report.get("floor") or {}
    if not f:
        return []
    if "error" in f:
        return ["", "**Compute floor**: failed: " + f["error"].strip().splitlines()[-1][:200]]
    mfu = f" = {f['mfu']:.1%} MFU of {f['peak_tflops']:g} TFLOP/s" if f.get("mfu") is not None else ""
    kernels = sorted({c["kernel"] for c in f.get("calls", []) if c["kind"] == "attention"})
    return ["", f"**Compute floor**: {f['floor_ms']:.1f} ms a step (GEMMs {f['ms_by_kind']['gemm']:.1f} ms, attention "
            f"{f['ms_by_kind']['attention']:.1f} ms with {', '.join(kernels)}): every GEMM (forward, both backward) "
            f"and attention call of one step of the flash-attn run timed alone and summed, {f['micro_batches']} "
            f"micro-batches of {f['micro_batch']}, {f['dtype']}; {_tflops(f['tflops'])} TFLOP/s{mfu}. "
            "`x floor` in the table above is the run's median step over it."]


def titan_lines(report: dict) -> list[str]:
    t = report.get("torchtitan") or {}
    if not t:
        return []
    if t.get("ran"):
        return ["", f"**torchtitan** (the single-GPU anchor): {t.get('summary')}"]
    return ["", f"**torchtitan** (the single-GPU anchor): not run: {t.get('why') or t.get('error', '')[-300:]}"]


def verdict(r: dict) -> str:
    """'gain' / 'loss' only where the flag run's and its base's step ranges do not overlap."""
    a, b = r.get("range"), r.get("base_range")
    if not (a and b):
        return "no step range"
    if a[1] < b[0]:
        return "gain"
    if a[0] > b[1]:
        return "loss"
    return "within the steps' spread"
