"""docs/design.md is the map and the contracts, short and true to the code: at most 200 lines,
every feature folder and every shared room under npuspeed/features/ named, every top-level module
and package of npuspeed/ in the map, and every `path` it names exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
MAX_LINES = 200


def _text() -> str:
    return DESIGN.read_text()


def test_design_is_short():
    lines = _text().splitlines()
    assert len(lines) <= MAX_LINES, f"docs/design.md has {len(lines)} lines (at most {MAX_LINES}): " \
                                    "mechanisms and history go to the feature pages"


def feature_entries() -> list[str]:
    """Every folder and shared module under npuspeed/features/ (the names the map must hold)."""
    base = ROOT / "npuspeed" / "features"
    folders = [p.name for p in base.iterdir() if p.is_dir() and (p / "__init__.py").is_file()]
    modules = [p.name for p in base.glob("*.py") if p.name != "__init__.py"]
    return sorted(folders + modules)


def missing_from(text: str, names: list[str]) -> list[str]:
    return [n for n in names if not re.search(rf"`{re.escape(n.removesuffix('.py'))}(\.py)?/?`|\b{re.escape(n)}\b", text)]


def test_every_feature_folder_and_shared_room_is_named():
    names = feature_entries()
    assert "device" in names and "moe_common" in names, names
    assert not missing_from(_text(), names), f"docs/design.md does not name: {missing_from(_text(), names)}"


def test_every_top_level_part_of_the_package_is_in_the_map():
    pkg = ROOT / "npuspeed"
    names = [p.name + "/" for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").is_file()]
    names += [p.name for p in pkg.glob("*.py") if p.name not in ("__init__.py", "_version.py")]
    text = _text()
    missing = [n for n in names if n not in text]
    assert not missing, f"docs/design.md's map lacks: {missing}"


def test_paths_it_names_exist():
    text = _text()
    named = set(re.findall(r"`((?:npuspeed|tests|benchmarks|docs|examples|scripts|tools|csrc)/[\w./-]+)`", text))
    gone = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert not gone, f"docs/design.md names paths that do not exist: {gone}"


def test_the_check_catches_a_missing_folder():
    text = _text()
    assert missing_from(text.replace("`dualpipev`", "`dual`").replace("dualpipev", "dual"), feature_entries()) == ["dualpipev"]
