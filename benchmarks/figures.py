"""Every figure in the README (and the docs pages in PAGES), rendered from a committed result file.

A figure in README.md, or in a docs page listed in PAGES, is written between two markers naming
its source:

    <!--fig:cpu-e2e-2026-11-22/tokens_ratio-->1.52-1.62x<!--/fig-->

`cpu-e2e-2026-11-22` is `benchmarks/measured/cpu-e2e-2026-11-22.json`: what was run (`what`),
the commit, the date, the machine, how the numbers got there (`provenance`: measured by the
script named, or transcribed from a docs page for figures measured before this folder existed,
whose raw files were not committed then), the raw numbers (`raw`) and, per figure, how its text
is computed from them (`figures`). `python benchmarks/figures.py` rewrites every marked figure
from its file; `--check` fails on any figure whose text is not what its file gives, and on any
figure-like number in the README outside the markers (tests/unit/test_readme_figures.py runs it).
A figure is a range over the runs, never the best run alone: the kinds below compute one.

Kinds (`figures.<name>.kind`):
- `range`: the raw list's min-max (one value when they agree; `sep` instead of "-" and `signed`
  (+/-) for signed values such as errors; a null entry, a failed run, has no value and is skipped)
- `pair_ratios`: every num_i / den_j over two raw lists (runs of A and B), as min-max
- `ratio`: raw[num] / raw[den] of two single values
- `max_abs`: the largest |value| of a raw list (errors, in the unit given); a null entry (a
  failed run, see count_within) has no value and is skipped
- `count_within`: "N of M": how many |value| <= bound; a null entry is a failed run: one of the M,
  never within, and the text says so ("N of M, F failed"), so a failure cannot drop out
- `value`: one raw value as it is
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "benchmarks" / "measured"
README = ROOT / "README.md"
# docs pages whose figures are rendered from result files too (marker by marker)
PAGES = [ROOT / "docs" / "plan.md"]
SPAN = re.compile(r"<!--fig:([\w.\-]+)/([\w.\-]+)-->(.*?)<!--/fig-->", re.S)
REQUIRED = ("what", "commit", "date", "machine", "provenance", "raw", "figures")
# what counts as a figure in prose: ratios (1.5x), percentages, exponents, sizes and times
FIGURE_LIKE = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e-?\d+)?(?:x\b|%|\s?(?:GiB|MiB|GB|MB|ms|TFLOP/s)\b)"
                         r"|(?<![\w.])\d+(?:\.\d+)?e-\d+\b")


class FigureError(Exception):
    pass


def load(name: str) -> dict:
    path = MEASURED / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except OSError:
        raise FigureError(f"{name}: no result file {path.relative_to(ROOT)}") from None
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise FigureError(f"{path.relative_to(ROOT)}: missing {', '.join(missing)}")
    return data


def _fmt(value: float, spec: dict) -> str:
    digits = spec.get("digits", 2)
    sign = "+" if spec.get("signed") else ""
    text = f"{value:{sign}.{digits}e}" if spec.get("sci") else f"{value:{sign}.{digits}f}"
    return text


def _span(lo: float, hi: float, spec: dict) -> str:
    unit = spec.get("unit", "")
    a, b = _fmt(lo, spec), _fmt(hi, spec)
    return f"{a}{unit}" if a == b else f"{a}{spec.get('sep', '-')}{b}{unit}"


def render(data: dict, figure: str) -> str:
    spec = data["figures"].get(figure)
    if spec is None:
        raise FigureError(f"no figure {figure!r} in the result file (it has {', '.join(data['figures'])})")
    raw = data["raw"]
    kind = spec["kind"]
    if kind == "range":
        values = [float(v) for v in raw[spec["from"]] if v is not None]
        return _span(min(values), max(values), spec)
    if kind == "pair_ratios":
        ratios = [n / d for n in raw[spec["num"]] for d in raw[spec["den"]]]
        return _span(min(ratios), max(ratios), spec)
    if kind == "ratio":
        return _fmt(raw[spec["num"]] / raw[spec["den"]], spec) + spec.get("unit", "")
    if kind == "max_abs":
        return _fmt(max(abs(v) for v in raw[spec["from"]] if v is not None), spec) + spec.get("unit", "")
    if kind == "count_within":
        values = raw[spec["from"]]
        failed = sum(v is None for v in values)
        within = sum(v is not None and abs(v) <= spec["bound"] for v in values)
        return f"{within} of {len(values)}" + (f", {failed} failed" if failed else "")
    if kind == "value":
        return _fmt(raw[spec["from"]], spec) + spec.get("unit", "")
    raise FigureError(f"figure {figure!r}: unknown kind {kind!r}")


def _outside_spans(text: str) -> str:
    """The README without its figure spans, code blocks, inline code and link targets."""
    blank = lambda m: re.sub(r"[^\n]", " ", m.group(0))  # noqa: E731  (line numbers kept)
    text = SPAN.sub(blank, text)
    text = re.sub(r"```.*?```", blank, text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", blank, text)
    return re.sub(r"\]\([^)]*\)", blank, text)


def problems(text: str, numbers_outside: bool = True) -> list[str]:
    """What is wrong with a page's figures: a span whose text its file does not give and (with
    `numbers_outside`, the README) a figure-like number outside the spans."""
    out = []
    for match in SPAN.finditer(text):
        name, figure, shown = match.groups()
        try:
            want = render(load(name), figure)
        except (FigureError, KeyError) as exc:
            out.append(f"{name}/{figure}: {exc}")
            continue
        if shown != want:
            out.append(f"{name}/{figure}: the page says {shown!r}, its result file gives {want!r}")
    for number, line in _unsourced(text) if numbers_outside else ():
        out.append(f"line {line}: {number!r} has no source: put it between <!--fig:FILE/NAME--> and "
                   "<!--/fig--> with a result file in benchmarks/measured/, or drop it")
    return out


def _unsourced(text: str) -> list[tuple[str, int]]:
    found = []
    for i, line in enumerate(_outside_spans(text).splitlines(), 1):
        found += [(m.group(0), i) for m in FIGURE_LIKE.finditer(line)]
    return found


def rewrite(text: str) -> str:
    return SPAN.sub(lambda m: f"<!--fig:{m.group(1)}/{m.group(2)}-->{render(load(m.group(1)), m.group(2))}<!--/fig-->",
                    text)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--check"]:
        found = problems(README.read_text())
        for page in PAGES:
            found += [f"{page.relative_to(ROOT)}: {p}" for p in problems(page.read_text(), numbers_outside=False)]
        print("\n".join(found) or f"{README.name} and {len(PAGES)} docs page(s): every figure renders from its "
              "result file")
        return 1 if found else 0
    for page in [README, *PAGES]:
        page.write_text(rewrite(page.read_text()))
    print(f"{README.name} and {', '.join(str(p.relative_to(ROOT)) for p in PAGES)}: figures rendered from "
          f"{MEASURED.relative_to(ROOT)}/")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
