"""`npuspeed report`: what will run here, before anything is launched.

The JSON form is a contract read by scripts: keys are only ever added.
"""
from __future__ import annotations

import platform

import torch


def _ops() -> list[dict]:
    from npuspeed.ops import catalog

    return catalog()


def collect() -> dict:
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
    }


def _fused_op_choices() -> list[dict]:
    """Per op and shape: which implementation the fused-op flags run, and why (measured)."""
    from npuspeed.ops import fused_choice

    return [dict(c.as_dict(), line=c.line()) for c in fused_choice.choices()]


def _attention_calls() -> dict:
    """Which kernel each --use-flash-attn call ran so far in this process, and why."""
    from npuspeed.features.fused_attention.forward import attention_calls

    return attention_calls()


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [headers]) for i in range(len(headers))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def render(data: dict) -> str:
    out = [
        f"npuspeed {data['npuspeed_version']}  torch {data['torch_version']}  "
        f"megatron-core {data['megatron_core_version']}  python {data['python_version']}",
        f"device: {data['device']} ({data['accelerator']['device_name']})  "
        f"dist backend: {data['dist_backend']}  memory: {data['accelerator']['memory_tracking']}",
        "",
        _table([[f["name"], "on" if f["enabled"] else "off", f["path"]] for f in data["features"]],
               ["feature", "state", "path in use"]),
        "",
        _table([[o["name"], "yes" if o["compiled"] else "no", o["implementation"]] for o in data["ops"]],
               ["op", "compiled", "implementation"]),
        "",
        _table([[p["target"], p["feature"], p["kind"], p["status"] + (f" ({p['reason']})" if p["reason"] else "")]
                for p in data["patches"]], ["patch target", "feature", "kind", "status"]),
    ]
    calls = data.get("attention_calls") or {}
    if calls.get("calls"):
        out += ["", "attention calls (kernel: count, why):"]
        out += [f"  - {k}: {n} ({calls['reasons'].get(k, '')})" for k, n in sorted(calls["calls"].items())]
    if data.get("fused_op_choices"):
        out += ["", "fused op choices (op [shape dtype device]: implementation (why)):"]
        out += [f"  - {c['line']}" for c in data["fused_op_choices"]]
    if data["notes"]:
        out += ["", "notes:"] + [f"  - {n}" for n in data["notes"]]
    return "\n".join(out)
