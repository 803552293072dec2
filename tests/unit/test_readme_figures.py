"""Every figure in the README traces to a committed result file through benchmarks/figures.py:
a figure whose text is not what its file gives, a figure-like number outside the markers, or a
result file without what was run, the commit, the date, the machine and the raw numbers fails."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _figures():
    spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "benchmarks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


figures = _figures()


def test_every_readme_figure_renders_from_its_result_file():
    assert figures.problems(figures.README.read_text()) == []


def test_every_docs_page_figure_renders_from_its_result_file():
    for page in figures.PAGES:
        assert figures.problems(page.read_text(), numbers_outside=False) == [], page.name


def test_a_failed_run_counts_against_a_count_figure():
    data = {"raw": {"err": [1.0, -12.0, None]}, "figures": {"n": {"kind": "count_within", "from": "err", "bound": 10},
                                                           "x": {"kind": "max_abs", "from": "err", "digits": 1},
                                                           "r": {"kind": "range", "from": "err", "digits": 1,
                                                                 "signed": True, "sep": " to ", "unit": "%"}}}
    assert figures.render(data, "n") == "1 of 3, 1 failed"
    assert figures.render(data, "x") == "12.0"
    assert figures.render(data, "r") == "-12.0 to +1.0%"


def test_every_result_file_is_complete():
    for path in sorted(figures.MEASURED.glob("*.json")):
        data = json.loads(path.read_text())
        assert not [k for k in figures.REQUIRED if not data.get(k)], path.name
        for name in data["figures"]:
            figures.render(data, name)  # every declared figure computes


def test_a_figure_without_a_source_fails():
    text = figures.README.read_text()
    assert figures.problems(text + "\nAll flags on: 1.91x tokens/s.\n")[-1].startswith("line ")
    # a figure edited by hand (the best run instead of the range) no longer matches its file
    span = "<!--fig:cpu-e2e-2026-11-22/tokens_ratio-->1.52-1.62x<!--/fig-->"
    assert span in text
    found = figures.problems(text.replace(span, span.replace("1.52-1.62x", "1.58x")))
    assert found and "gives '1.52-1.62x'" in found[0]
    found = figures.problems(text.replace(span, span.replace("cpu-e2e-2026-11-22", "cpu-e2e-lost")))
    assert found and "no result file" in found[0]


@pytest.mark.parametrize("line", ["peak 0.52x of CP 1", "within 6.6%", "grads within 1.8e-7", "9.3 GiB",
                                  "a 352.7 ms step"])
def test_figure_like_numbers_are_caught(line):
    assert figures._unsourced(line), line


@pytest.mark.parametrize("line", ["megatron-core 0.12 to 0.19", "Python 3.11 and 3.12", "torch 2.13.0",
                                  "`--coc-parallel-num 2`", "2 ranks, TP2 + SP"])
def test_versions_and_flags_are_not_figures(line):
    assert not figures._unsourced(line), line
