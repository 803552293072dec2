"""The docs keep their shape (issue 35): a README a newcomer reads in ten minutes, one page per
feature folder under docs/features/, and no relative link that leads nowhere."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FEATURES = ROOT / "npuspeed" / "features"
README_MAX_LINES = 300
TABLE_ROW_MAX_CHARS = 210  # the feature table: short cells and a link, never a paragraph per cell
FIGURE_MARK = re.compile(r"<!--/?fig[^>]*-->")  # benchmarks/figures.py's markers around a figure
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _folder_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["npuspeed", "features"] and len(parts) > 2 else None


def _defining_folders() -> dict[str, set[str]]:
    """folder -> feature names: the registry's features (all_features()) by their class's module,
    plus any class in a feature folder whose base is named *Feature (so an unregistered one counts)."""
    from npuspeed.features import all_features

    found: dict[str, set[str]] = {}
    for feature in all_features():
        folder = _folder_of(type(feature).__module__)
        assert folder, f"{type(feature).__name__} lives outside npuspeed/features/<folder>/"
        found.setdefault(folder, set()).add(feature.name)
    for path in FEATURES.glob("*/*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", getattr(b, "attr", "")).endswith("Feature") for b in node.bases):
                found.setdefault(path.parent.name, set()).add(node.name)
    return found


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail to docs/")
    shown = [FIGURE_MARK.sub("", line) for line in lines]  # a figure's source markers are not shown
    long_rows = [f"line {i}: {len(line)} chars" for i, line in enumerate(shown, 1)
                 if line.startswith("|") and len(line) > TABLE_ROW_MAX_CHARS]
    assert not long_rows, f"README.md table rows over {TABLE_ROW_MAX_CHARS} characters: {long_rows}"


def test_every_feature_folder_has_a_docs_page():
    folders = _defining_folders()
    assert len(folders) >= 10, folders  # the scan found the features, not nothing
    missing = sorted(f"docs/features/{folder}.md (defines {', '.join(sorted(names))})"
                     for folder, names in folders.items() if not (ROOT / "docs" / "features" / f"{folder}.md").is_file())
    assert not missing, f"feature folders without a docs page: {missing}"


def test_every_docs_feature_page_has_a_feature_folder():
    folders = _defining_folders()
    stray = sorted(p.name for p in (ROOT / "docs" / "features").glob("*.md") if p.stem not in folders)
    assert not stray, f"docs/features pages for no feature folder (renamed or removed?): {stray}"


def test_readme_links_every_feature_page():
    text = (ROOT / "README.md").read_text()
    unlinked = sorted(p.name for p in (ROOT / "docs" / "features").glob("*.md")
                      if f"(docs/features/{p.name})" not in text)
    assert not unlinked, f"README.md's feature table has no link to: {unlinked}"


def test_relative_links_resolve():
    broken = []
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, f"relative links to missing files: {broken}"
