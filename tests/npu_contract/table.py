"""The README's table: per torch_npu op npuspeed calls and per release, what the tier checks.

`python tests/npu_contract/table.py` (from the repository root) prints it as Markdown.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from npu_contract import standin, wheel, wheel_contract  # noqa: E402
from npu_contract.emulators import all_emulators  # noqa: E402


def rows(ops) -> list[str]:
    out = ["| torch_npu op | " + " | ".join(wheel.RELEASES) + " |",
           "|---|" + "---|" * len(wheel.RELEASES)]
    # per release, read once: (schemas, meta functions, ATB ops, emulators)
    found = {release: (*standin.contract(release), wheel_contract.atb_schemas(wheel.files(release)),
                       all_emulators(release)) for release in wheel.RELEASES}
    for op in ops:
        cells = []
        for release in wheel.RELEASES:
            schemas, metas, atb, emulators = found[release]
            if op not in schemas:
                cells.append("absent (npuspeed takes its own path)")
                continue
            parts = ["signature of the ATB library's symbol" if op in atb else "schema",
                     "meta shapes" if op in metas else "no meta function in the wheel"]
            if op in emulators:
                parts.append("emulated")
            cells.append(", ".join(parts))
        out.append(f"| `{op}` | " + " | ".join(cells) + " |")
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from npuspeed.accelerator import npu_ops  # noqa: E402

    print("\n".join(rows(sorted(npu_ops.USED_BY))))
