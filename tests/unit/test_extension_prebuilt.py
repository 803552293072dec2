"""The pip-built op library is found per interpreter, and one built for another torch falls
back to a JIT build instead of turning the C++ ops off (a checkout serving two venvs)."""
from __future__ import annotations

import importlib.machinery

from npuspeed.ops import _extension


def _fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(_extension, "_PACKAGE_DIR", tmp_path)
    monkeypatch.setattr(_extension, "_STATUS", None)
    monkeypatch.delenv("NPUSPEED_JIT", raising=False)
    monkeypatch.delenv("NPUSPEED_DISABLE_CPP", raising=False)


def test_prebuilt_is_this_interpreters(monkeypatch, tmp_path):
    _fresh(monkeypatch, tmp_path)
    other = "cpython-399-x86_64-linux-gnu"
    (tmp_path / f"_C.{other}.so").write_bytes(b"x")
    assert _extension._prebuilt() is None  # another Python's library is never picked
    mine = tmp_path / f"_C{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    mine.write_bytes(b"x")
    assert _extension._prebuilt() == str(mine)


def test_unloadable_prebuilt_falls_back_to_jit(monkeypatch, tmp_path):
    _fresh(monkeypatch, tmp_path)
    (tmp_path / f"_C{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"not a library")
    built = []

    def fake_jit(sources):
        built.append(len(sources))
        return "jit-path"

    monkeypatch.setattr(_extension, "_jit_build", fake_jit)
    monkeypatch.setattr(_extension, "source_files", lambda: ["a.cpp"])
    status = _extension.load_library()
    assert built == [1], status
    # the stand-in path is no library, so the capability query after it may fail: only the
    # route matters here (the JIT build was asked for, with the prebuilt's failure logged)
    assert status["path"] in (None, "jit-path") and status["source"] in ("jit", "failed")
