"""The device report's figures from its JSON: derived tables, the Markdown, the PNG plots.
Everything here reads report.json's sections only, so a report can be re-rendered anywhere."""
from __future__ import annotations

from pathlib import Path

import why

GiB = 2**30
#: flag run -> the counters that name what it ran
COUNTERS = {"reuse-fp32-param": "reuse.codec.", "swap-optimizer": "swap_optimizer.",
            "swap-optimizer gbs64": "swap_optimizer.", "gradient-accumulation-fusion": "grad_accum_fusion.",
            "swap-attention": "swap."}


def _ok(run: dict | None) -> bool:
    return bool(run) and "error" not in run


def _ratio(a, b):
    return a / b if a and b else None


def derive(report: dict) -> dict:
    """e2e rows (against all off), per-flag rows (against their flash-attn base) and the codec's
    share of a step, from the training and codec sections."""
    training = report.get("training") or {}
    runs = training.get("runs") or {}
    off = runs.get("all off")
    e2e, floor_ms = [], why.floor_ms(report)
    for name in training.get("e2e", []):
        run = runs.get(name)
        if not _ok(run):
            e2e.append({"name": name, "error": (run or {}).get("error", "not run")[:200]})
            continue
        e2e.append({"name": name, "tokens_per_s": run["tokens_per_s"],
                    "vs_off": _ratio(run["tokens_per_s"], off["tokens_per_s"]) if _ok(off) else None,
                    "tflops": run.get("tflops_per_s_per_rank"), "mfu": run.get("mfu"),
                    "peak_gib": run["peak_mem_bytes"] / GiB, "flags": training["flags"][name],
                    "x_floor": _ratio(run["median_step_ms"], floor_ms)})
    flags = []
    for name, base_name in (training.get("base_of") or {}).items():
        run, base = runs.get(name), runs.get(base_name)
        if not (_ok(run) and _ok(base)):
            flags.append({"name": name, "base": base_name,
                          "error": ((run or {}).get("error") or (base or {}).get("error") or "not run")[:200]})
            continue
        prefix = COUNTERS.get(name, "")
        flags.append({"name": name, "base": base_name, "step_ms": run["median_step_ms"],
                      "base_step_ms": base["median_step_ms"],
                      "time_ratio": _ratio(run["median_step_ms"], base["median_step_ms"]),
                      "range": _range(run), "base_range": _range(base),
                      "peak_gib": run["peak_mem_bytes"] / GiB, "base_peak_gib": base["peak_mem_bytes"] / GiB,
                      "ran": {k: v for k, v in (run.get("npuspeed_counters") or {}).items()
                              if prefix and k.startswith(prefix)}})
    codec = report.get("codec") or {}
    base = runs.get("flash-attn")
    share = []
    for t in codec.get("timings") or []:
        if _ok(base):
            share.append({**t, "step_ms": base["median_step_ms"], "share": t["ms_per_step"] / base["median_step_ms"]})
    return {"e2e": e2e, "flags": flags, "codec_share": share}


def _range(run: dict) -> list[float] | None:
    """The fastest and slowest step after the first, the profiled ones and their warm-up left
    out (None where the run kept no step times)."""
    first, profiled = run.get("first_iteration") or 1, set(run.get("profiled_iterations") or ())
    steps = [t for i, t in enumerate(run.get("step_ms") or []) if i > 0 and first + i not in profiled]
    return [min(steps), max(steps)] if steps else None


def _f(x, fmt="{:.2f}", none="-"):
    return none if x is None else fmt.format(x)


def _fused_rows(section: dict) -> list[str]:
    lines = ["| op, shape | dtype | peer | Megatron's default ms | peer ms | speedup | pick |", "|---|---|---|---|---|---|---|"]
    for r in section.get("rows") or []:
        case, _, peer = r["case"].rpartition(" [")
        chosen = (r["extra"].get("chosen") or {}).get("impl") or (r["extra"].get("chosen") or {}).get("path") or ""
        lines.append(f"| {case} | {r['dtype']} | {peer.rstrip(']')} | {float(r['baseline_ms']):.3f} | "
                     f"{float(r['feature_ms']):.3f} | {float(r['speedup']):.2f}x | {chosen} |")
    return lines


def _choice_rows(table: dict) -> list[str]:
    """The fused ops' kernel table (bench_fused_choice.py): one row per candidate per op and
    shape, the flags' own measurement, the pick marked; dropped candidates with their reason."""
    model = table.get("model") or {}
    lines = [f"Shapes of the training runs' model (hidden {model.get('hidden')}, ffn {model.get('ffn')}, "
             f"heads {model.get('heads')}/{model.get('groups')}, S {model.get('seq')}, micro-batch "
             f"{model.get('micro_batch')}); each op's candidates timed by the flags' own chooser (fwd+bwd, "
             "minimum of interleaved rounds; a first call's compile or JIT is not counted: its own column)."]
    if table.get("megatron_stand_ins"):
        lines.append(f"megatron-core did not import: npuspeed's references stood in for {', '.join(table['megatron_stand_ins'])}.")
    failure = (table.get("compile") or {}).get("failure")
    if failure:
        lines.append(f"torch.compile was dropped: {failure}.")
    lines += ["", "| op, shape | candidate | fwd+bwd ms | x Megatron | first call s | pick |", "|---|---|---|---|---|---|"]
    for c in table.get("choices") or []:
        ms, first, base = c.get("ms") or {}, c.get("first_ms") or {}, c.get("baseline", "megatron")
        base_ms = ms.get("megatron")
        for name, t in sorted(ms.items(), key=lambda kv: kv[1]):
            ratio = f"{base_ms / t:.2f}x" if base_ms and t else "-"
            lines.append(f"| {c['op']} {c['shape']} | {name} | {t:.3f} | {ratio} | "
                         f"{_f(first.get(name) and first[name] / 1e3, '{:.2f}')} | {'**picked**' if name == c['impl'] else ''} |")
        for name, why in (c.get("dropped") or {}).items():
            lines.append(f"| {c['op']} {c['shape']} | {name} | dropped: {why[:100]} | | | |")
        if not ms:
            lines.append(f"| {c['op']} {c['shape']} | {c['impl']} | not measured: {c['why'][:100]} | | | **picked** |")
    return lines


def _triton_failures(section: dict) -> list[str]:
    return [f"- {f['op']} {f['dtype']}: failed, {f['error'][:200]} (the bench's log in the report's folder)"
            for f in section.get("failures") or []]


def markdown(report: dict, derived: dict) -> str:
    m = report["meta"]
    out = [f"Device report of {m['date']}: {m['device_name']} ({m['device']}), torch {m['torch']}, triton "
           f"{m['triton']}, megatron-core {m['megatron_core']}, Python {m['python']}, commit {m['commit']}; "
           f"{m['wall_s']:.0f} s of a {m['budget_s']:.0f} s budget"
           + (" (**smoke run**: a tiny model checking the report's code; the figures mean nothing)" if m["smoke"] else "")
           + "."]
    tier = report.get("tier") or {}
    out += ["", "**Device tier** (`make test-device`): "
            + (", ".join(f"{n} {s}" for s, n in tier["counts"].items()) if "counts" in tier
               else tier.get("error") or tier.get("skipped") or "not run")
            + (f" (from the `pytest -v` log of a call of its own, {tier['from_log']})" if tier.get("from_log") else "")]
    for c in tier.get("cases", []):
        if c["state"] == "failed":
            out.append(f"- FAILED `{c['test']}`: {c['message'][:200]}")
    out += ["", "**End to end** (Llama-style 8 layers, hidden 2048, GQA 16/4, ffn 5632, S 4096, bf16, dropout "
            "0.1, micro-batch 1, global batch 8, 1 device; median step, first iteration left out):", "",
            "| configuration | tokens/s | vs all off | TFLOP/s | MFU | peak GiB | x floor |", "|---|---|---|---|---|---|---|"]
    for r in derived["e2e"]:
        if "error" in r:
            out.append(f"| {r['name']} | failed: {r['error'][:120]} | | | | | |")
        else:
            out.append(f"| {r['name']} | {r['tokens_per_s']:.0f} | {_f(r['vs_off'], '{:.2f}x')} | {_f(r['tflops'], '{:.1f}')} "
                       f"| {_f(r['mfu'], '{:.1%}')} | {r['peak_gib']:.2f} | {_f(r.get('x_floor'), '{:.2f}x')} |")
    out += why.floor_lines(report) + why.profile_lines(report)
    out += ["", "**One flag at a time** (against flash attention alone, same model and batch):", "",
            "| flag run | median step ms (base); fastest-slowest | x step | peak GiB (base) | what ran |", "|---|---|---|---|---|"]
    for r in derived["flags"]:
        if "error" in r:
            out.append(f"| {r['name']} | failed: {r['error'][:120]} | | | |")
        else:
            ran = ", ".join(f"{k}={v}" for k, v in sorted(r["ran"].items())[:6])
            steps = (f"; steps {r['range'][0]:.0f}-{r['range'][1]:.0f} ({r['base_range'][0]:.0f}-{r['base_range'][1]:.0f})"
                     if r.get("range") and r.get("base_range") else "")
            spread = f" ({why.verdict(r)})" if r.get("range") and r.get("base_range") else ""
            out.append(f"| {r['name']} | {r['step_ms']:.1f} ({r['base_step_ms']:.1f}){steps} | {_f(r['time_ratio'], '{:.3f}x')}{spread} "
                       f"| {r['peak_gib']:.2f} ({r['base_peak_gib']:.2f}) | {ran} |")
    for s in derived["codec_share"]:
        out.append(f"- `--reuse-fp32-param` codec ({s['codec']}, {s['params'] / 1e6:.0f}M masters, "
                   f"{'one buffer' if s['one_buffer'] else 'one tensor per 1 Mi'}): {s['ms_per_step']:.2f} ms a step, "
                   f"{s['share']:.1%} of the flash-attn step, {s['gb_per_s']:.0f} GB/s")
    out += why.titan_lines(report)
    for key, title in (("fused_ops", "Fused ops"), ("triton_ops", "Triton kernels")):
        section = report.get(key) or {}
        if section.get("table"):  # the flags' own measurement (bench_fused_choice.py)
            out += ["", f"**{title}** (what --use-fused-rmsnorm, -swiglu and -rotary-pos-emb choose among):", ""]
            out += _choice_rows(section["table"])
            continue
        out += ["", f"**{title}** (fwd+bwd; speedup = Megatron's default or the named peer over the other column):", ""]
        out += _fused_rows(section) if section.get("rows") else [_last_line(section.get("error")) or section.get("skipped")
                                                                   or "not run"]
        out += _triton_failures(section)
    return "\n".join(out) + "\n"


def _last_line(error: str | None) -> str | None:
    """A failed bench's exception line (its whole output is in the part's log next to the report)."""
    lines = [line.strip() for line in (error or "").splitlines() if line.strip()]
    return f"failed: {lines[-1]} (the whole output: the bench's log in the report's folder)" if lines else None


def plots(derived: dict, out: Path) -> list[str]:
    """e2e.png (tokens/s and peak) and flags.png (step ratio and peak); [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    for name, rows, bars in (("e2e", derived["e2e"], ("tokens_per_s", "peak_gib")),
                             ("flags", derived["flags"], ("time_ratio", "peak_gib"))):
        rows = [r for r in rows if "error" not in r]
        if not rows:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
        for ax, key in zip(axes, bars):
            ax.bar([r["name"] for r in rows], [r[key] or 0 for r in rows])
            ax.set_ylabel(key)
            ax.tick_params(axis="x", rotation=30, labelsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
        made.append(f"{name}.png")
    return made
