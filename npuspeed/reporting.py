"""`npuspeed report`: what will run here, before anything is launched.

The JSON form is a contract read by scripts: keys are only ever added.
"""
from __future__ import annotations

import platform

import torch

from npuspeed.throughput import measure_gemm_tflops, peak_tflops


def _ops() -> list[dict]:
    from npuspeed.ops import catalog

    return catalog()


def collect(measure_peak: bool = False) -> dict:
    from npuspeed import runtime, telemetry
    from npuspeed._version import __version__
    from npuspeed.patching import registry
    from npuspeed.patching.versions import megatron_version

    state = runtime.state() or runtime.initialize([])
    acc, ctx = state.accelerator, state.context
    return {
        "npuspeed_version": __version__,
        "device": acc.name,
        "dist_backend": acc.dist_backend,
        "torch_version": torch.__version__,
        "megatron_core_version": str(megatron_version()),
        "python_version": platform.python_version(),
        "accelerator": acc.describe(),
        "features": [
            {"name": f.name, "enabled": on, "path": f.path(ctx) if on else "off",
             "flags": list(f.flags)}
            for f, on in state.features
        ],
        "patches": registry.report(),
        "ops": _ops(),
        "notes": list(state.notes),
        "late_import": state.late_import,
        "counters": telemetry.snapshot(),
        "attention_calls": _attention_calls(),
        "fused_op_choices": _fused_op_choices(),
        # every path choice in the process, one record shape (npuspeed.ops.choose.record.Choice):
        # the fused ops, fused attention's fallback, the weight gradient, fused linear cross-entropy
        "path_choices": _path_choices(),
        # the expert all-to-alls this process ran so far (--moe-fb-overlap, --moe-alltoall-overlap-comm):
        # the share of their time in flight the compute did not wait for, per phase (None: none ran)
        "a2a_hidden_fraction": _a2a_hidden(),
        # on an NPU: torch_npu's release and, per op npuspeed calls, whether it has it (None elsewhere)
        "torch_npu": _torch_npu(acc),
        # the Adam megatron-core gets where it falls back to torch's (no TE/apex): what this device
        # runs ("planned"), and every torch Adam/AdamW built in this process so far ("built")
        "adam": _adam(ctx),
        # the table's bf16 dense peak for this device (None: not in the table, e.g. CPU) and,
        # with --measure-peak, a large GEMM's measured TFLOP/s (for --device-peak-tflops)
        "device_peak_tflops": peak_tflops(acc.device_name()),
        # --swap-attention / --swap-optimizer: each sizing decision this process made (what moves,
        # bytes, estimated and measured wait, hidden share, what stays and why; [] before one)
        "swap_sizing": _swap_sizing(),
        # the host<->device links this process measured, by backend ({} before a swap asked)
        "host_link": _host_link(),
        **_measured_peak(acc, measure_peak),
    }


def _measured_peak(acc, measure: bool) -> dict:
    if not measure:
        return {"measured_peak_tflops": None, "measured_peak": None}
    import torch

    dtype = torch.bfloat16 if acc.is_bf16_supported() else torch.float32
    found = measure_gemm_tflops(acc.device(), acc.synchronize, dtype=dtype)
    return {"measured_peak_tflops": found["tflops"], "measured_peak": found}


def _swap_sizing() -> list[dict]:
    from npuspeed.offload import decisions

    return decisions.all_dicts()


def _host_link() -> dict:
    from npuspeed.accelerator import host_link

    return host_link.reported()


def _torch_npu(acc) -> dict | None:
    from npuspeed.accelerator.npu_ops import availability

    return availability(acc)


def _fused_op_choices() -> list[dict]:
    """Per op and shape: which implementation the fused-op flags run, and why (measured)."""
    from npuspeed.ops import fused_choice

    return [dict(c.as_dict(), line=c.line()) for c in fused_choice.choices()]


def _path_choices() -> list[dict]:
    """Every chooser's records, named by the chooser (the one rule: npuspeed.ops.choose)."""
    from npuspeed.ops.choose.chooser import all_choosers

    return [dict(c.as_dict(), chooser=chooser.name, line=c.line())
            for chooser in sorted(all_choosers(), key=lambda ch: ch.name) for c in chooser.choices.values()]


def _adam(ctx) -> dict:
    from npuspeed.features.device import DeviceFeature, fused_adam

    mode = DeviceFeature().config(ctx.args).npuspeed_adam
    return {"mode": mode, "planned": fused_adam.plan_line(mode, device_type=ctx.accelerator.device().type),
            "built": fused_adam.built(), "implementation": fused_adam.summary()}


def _a2a_hidden() -> dict | None:
    from npuspeed.features.moe_common import a2a_clock

    return a2a_clock.summary()


def _attention_calls() -> dict:
    """Which kernel each --use-flash-attn call ran so far in this process, and why."""
    from npuspeed.features.fused_attention.forward import attention_calls

    return attention_calls()


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [headers]) for i in range(len(headers))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def render(data: dict, patches: bool = False) -> str:
    """The human form. The features that are on come first, each with its path (the others on
    one line), the ops, then what ran; the table of every patch target (about 80 rows) only with
    `patches` (`npuspeed report --patches`), else one line counting them."""
    features = data["features"]
    out = [
        f"npuspeed {data['npuspeed_version']}  torch {data['torch_version']}  "
        f"megatron-core {data['megatron_core_version']}  python {data['python_version']}",
        f"device: {data['device']} ({data['accelerator']['device_name']})  "
        f"dist backend: {data['dist_backend']}  memory: {data['accelerator']['memory_tracking']}",
        "",
        _table([[f["name"], "on", f["path"]] for f in features if f["enabled"]], ["feature", "state", "path in use"]),
        "off: " + (", ".join(f["name"] for f in features if not f["enabled"]) or "none"),
        "",
        _table([[o["name"], "yes" if o["compiled"] else "no", o["implementation"]] for o in data["ops"]],
               ["op", "compiled", "implementation"]),
        "",
        _patches(data["patches"], patches),
    ]
    counters = {k: v for k, v in (data.get("counters") or {}).items() if isinstance(v, (int, float)) and v}
    if counters:
        out += ["", "counters (what ran, how often):"]
        out += [f"  - {k}: {v:g}" for k, v in sorted(counters.items())]
    calls = data.get("attention_calls") or {}
    if calls.get("calls"):
        out += ["", "attention calls (kernel: count, why):"]
        out += [f"  - {k}: {n} ({calls['reasons'].get(k, '')})" for k, n in sorted(calls["calls"].items())]
    if data.get("fused_op_choices"):
        out += ["", "fused op choices (op [shape dtype device]: implementation (why)):"]
        out += [f"  - {c['line']}" for c in data["fused_op_choices"]]
    others = [c for c in data.get("path_choices") or [] if c["chooser"] != "fused ops"]
    if others:
        out += ["", "other path choices (chooser: op [key]: path (why)):"]
        out += [f"  - {c['chooser']}: {c['line']}" for c in others]
    sized = data.get("swap_sizing") or []
    if sized:
        out += ["", "swap sizing (per decision; measured wait after it):"]
        out += [f"  - {d['line']}; measured wait "
                + ("not yet" if d["exposed_ms_measured"] is None else
                   f"{d['exposed_ms_measured']:.2f} ms ({d['hidden_share_measured']:.0%} hidden)") for d in sized]
    for name, link in (data.get("host_link") or {}).items():
        out += [f"host link ({name}): {link['line']}"]
    adam = data.get("adam")
    if adam:
        out += ["", f"adam: {adam['planned']}"
                + (f"; built in this process: {adam['implementation']}" if adam["implementation"] else "")]
    out += ["", *_torch_npu_lines(data)]
    out += ["", _peak_line(data)]
    if data["notes"]:
        out += ["", "notes:"] + [f"  - {n}" for n in data["notes"]]
    return "\n".join(out)


def _patches(rows: list[dict], whole: bool) -> str:
    if whole:
        return _table([[p["target"], p["feature"], p["kind"],
                        p["status"] + (f" ({p['reason']})" if p["reason"] else "")]
                       for p in rows], ["patch target", "feature", "kind", "status"])
    applied = [p for p in rows if p["status"] == "applied"]
    by_feature = sorted({p["feature"] for p in applied})
    return (f"patches: {len(applied)} applied ({', '.join(by_feature) or 'none'}), "
            f"{len(rows) - len(applied)} skipped; `npuspeed report --patches` lists every target")


def _torch_npu_lines(data: dict) -> list[str]:
    found = data.get("torch_npu")
    if not found:
        return [f"torch_npu: not used (no NPU: the device is {data['device']})"]
    ops = found["ops"]
    return [f"torch_npu {found['version']}: {sum(o['found'] for o in ops.values())} of {len(ops)} ops npuspeed calls",
            _table([[op, "yes" if o["found"] else "NO", o["used_by"]] for op, o in ops.items()],
                   ["torch_npu op", "found", "used by"])]


def _peak_line(data: dict) -> str:
    table = data.get("device_peak_tflops")
    line = f"bf16 dense peak (table): {f'{table:g} TFLOP/s' if table else 'none for this device'}"
    found = data.get("measured_peak")
    if found:
        line += (f"; measured: {found['tflops']:.3f} TFLOP/s ({found['dtype']} GEMM {found['n']}^3, best of "
                 f"{found['repeats']}; median {found['median_tflops']:.3f}): pass --device-peak-tflops "
                 f"{found['tflops']:.3g} for the example's mfu")
    else:
        line += " (npuspeed report --measure-peak times a bf16 GEMM)"
    return line
