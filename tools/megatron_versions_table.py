"""The Markdown summary of scripts/megatron_versions.sh: release x feature, applied / refused
with the reason, and each applied flag's parity, from the JSON files the per-release tests
wrote (tests/distributed/test_megatron_versions.py, NPUSPEED_VERSIONS_OUT).

    python tools/megatron_versions_table.py DIR [SKIPPED_RELEASE=why ...]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from packaging.version import Version


def _load(out: Path, kind: str) -> dict:
    found = {}
    for path in out.glob(f"{kind}-*.json"):
        found[path.stem[len(kind) + 1:]] = json.loads(path.read_text())
    return found


def cell(outcome: dict | None, parity: dict | None) -> str:
    if outcome is None:
        return "not run"
    if outcome["status"] == "refused":
        return "refused: " + outcome["reason"].replace("|", "/")
    if outcome["status"] != "applied":
        return f"**{outcome['status']}**: {outcome.get('reason', '')}"
    text = f"applied ({outcome['patches']}/{outcome['of']} patches)"
    if parity is not None:
        diff = float(parity["max_abs_diff"])
        text += f", parity {'ok' if diff <= 1e-5 else '**FAILED**'} (max loss diff {diff:.1e})"
    return text


def table(out: Path, skipped: dict) -> str:
    features, parity, reports = _load(out, "features"), _load(out, "parity"), _load(out, "report")
    releases = sorted(set(features) | set(reports) | set(skipped), key=Version)
    names = sorted({n for f in features.values() for n in f["features"]})
    lines = ["| feature | " + " | ".join(releases) + " |", "|---" * (len(releases) + 1) + "|"]
    tp2 = ["TP2+SP run"] + [("losses " + " > ".join(f"{x:.3f}" for x in reports[r]["tp2_sp_losses"][::3]))
                            if r in reports else skipped.get(r, "not run") for r in releases]
    lines.append("| " + " | ".join(tp2) + " |")
    for name in names:
        row = [name] + [skipped[r] if r in skipped else
                        cell(features.get(r, {}).get("features", {}).get(name), parity.get(r, {}).get(name))
                        for r in releases]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    skipped = dict(arg.split("=", 1) for arg in sys.argv[2:])
    print(table(Path(sys.argv[1]), skipped))
