"""The Markdown summary of scripts/megatron_versions.sh: release x feature, applied / refused
with the reason, and each applied flag's parity, from the JSON files the per-release tests
wrote (tests/distributed/test_megatron_versions.py, NPUSPEED_VERSIONS_OUT).

    python tools/megatron_versions_table.py DIR [SKIPPED_RELEASE=why ...]
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from packaging.version import Version


def _load(out: Path, kind: str) -> dict:
    found = {}
    for path in out.glob(f"{kind}-*.json"):
        found[path.stem[len(kind) + 1:]] = json.loads(path.read_text())
    return found


def cell(outcome: dict | None, parity: dict | None) -> str:
    """Compact: the README's table has one column per release (the refusals are listed below it)."""
    if outcome is None:
        return "not run"
    if outcome["status"] == "refused":
        needs = re.search(r">=\d+\.\d+,<\d+\.\d+", outcome["reason"])
        return f"refused (needs {needs.group(0)})" if needs else "refused*"
    if outcome["status"] != "applied":
        return f"**{outcome['status']}**: {outcome.get('reason', '')}"
    text = f"applied {outcome['patches']}/{outcome['of']}"
    if parity is not None:
        diff = float(parity["max_abs_diff"])
        text += f", parity {'ok' if diff <= 1e-5 else '**FAILED**'} ({diff:.0e})"
    return text


def refusals(features: dict) -> list[str]:
    """Each feature's refusal line once (the newest release's wording), for below the table."""
    seen = {}
    for release in sorted(features, key=Version):
        for name, outcome in features[release]["features"].items():
            if outcome["status"] == "refused":
                seen[name] = (release, outcome["reason"])
    return [f"- `{name}` on {release}: {reason}" for name, (release, reason) in sorted(seen.items())]


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
    lines += ["", "Applied n/m: patches applied of those the feature registers (the rest are ranged to other",
              "releases); parity: max |loss difference| over 3 iterations against the run without the flag.",
              "Refusals, one line each (the run stops at start-up with it):", ""] + refusals(features)
    return "\n".join(lines)


if __name__ == "__main__":
    skipped = dict(arg.split("=", 1) for arg in sys.argv[2:])
    print(table(Path(sys.argv[1]), skipped))
