"""Many short example runs in one interpreter (tests/_forked_example.py forks one child per row).

mode "fresh": only torch is imported first, each child runs `import npuspeed.megatron_adaptor`
itself (rows with npuspeed flags or device variables); "initialized": the adaptor ran once
with no flags and megatron.core is imported (rows that fail in the example).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from launch import ROOT, free_port
from tiers import pinned

RUNNER = Path(__file__).with_name("_forked_example.py")


def run_rows(mode: str, rows: list[tuple[list[str], dict]]) -> list[dict]:
    """[(argv, env)] -> [{"rc", "stdout", "stderr"}], in order."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    for key in ("NPUSPEED_ARGS", "NPUSPEED_DEBUG", "RANK", "WORLD_SIZE"):
        env.pop(key, None)
    pinned(env)  # the CPU tier's backend; a row's own NPUSPEED_DEVICE still wins
    payload = json.dumps([{"argv": argv, "env": extra} for argv, extra in rows])
    proc = subprocess.run([sys.executable, str(RUNNER), mode], input=payload, capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("npuspeed: error: ")]
