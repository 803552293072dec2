"""`make test`'s split of the multi-process files between the Pythons (tests/shards.py): every
file named exists and holds tests, each Python gets its own files plus the unnamed ones, an
unset variable runs everything, a wrong value is one line, and the Makefile sets it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import shards

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def test_every_split_file_exists_and_names_a_python():
    for rel, python in shards.SPLIT.items():
        assert (TESTS / rel).is_file(), f"tests/shards.py names {rel}, which does not exist: drop it"
        assert python in shards.PYTHONS, (rel, python)
        assert "def test_" in (TESTS / rel).read_text(), rel


def test_each_python_runs_its_own_files_and_the_unnamed_ones():
    named = TESTS / next(iter(shards.SPLIT))
    other = next(p for p in shards.PYTHONS if p != shards.SPLIT[next(iter(shards.SPLIT))])
    unnamed = TESTS / "distributed" / "test_megatron_versions.py"
    assert unnamed.relative_to(TESTS).as_posix() not in shards.SPLIT
    assert shards.runs_here(named, TESTS, shards.SPLIT[next(iter(shards.SPLIT))])
    assert not shards.runs_here(named, TESTS, other)
    assert all(shards.runs_here(unnamed, TESTS, p) for p in shards.PYTHONS)
    assert shards.runs_here(named, TESTS, None)


def test_the_variable(monkeypatch):
    monkeypatch.delenv(shards.VAR, raising=False)
    assert shards.shard() is None
    monkeypatch.setenv(shards.VAR, "3.12")
    assert shards.shard() == "3.12"
    monkeypatch.setenv(shards.VAR, "3.13")
    with pytest.raises(RuntimeError, match="NPUSPEED_TEST_SHARD='3.13': set it to one of 3.11, 3.12"):
        shards.shard()


def test_collection_deselects_the_other_pythons_files():
    rel = next(r for r, p in shards.SPLIT.items() if p == "3.12")
    env = {**__import__("os").environ, shards.VAR: "3.11"}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", f"tests/{rel}",
                          "tests/distributed/test_megatron_versions.py"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300).stdout
    assert rel not in out and "test_megatron_versions.py::" in out, out[-2000:]


def test_the_makefile_gives_each_suite_its_share():
    make = (ROOT / "Makefile").read_text()
    assert f"{shards.VAR}=3.11 $(PY311) -m pytest" in make and f"{shards.VAR}=3.12 $(PY312) -m pytest" in make
