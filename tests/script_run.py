"""Run a test's Python script in a fresh interpreter (Triton's interpreter mode and Megatron's
import must not leak into the test session) and read the JSON its last line prints."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_triton_script(script: str, *argv: str, timeout: int = 300):
    """`python -c script *argv` with this checkout on PYTHONPATH, from the repository root; its
    last stdout line as JSON. Skips where triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed here (pip install -e .[test] on Linux x86_64)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", script, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
