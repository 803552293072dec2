"""The example at TP2 + sequence parallel: --use-flash-attn matches the run without it.

fp32, 8 iterations, |loss difference| <= 1e-4 at every iteration. Attention dropout is 0
(the fused and unfused kernels draw different dropout masks by construction); hidden
dropout stays on, so the RNG streams must line up too.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "pretrain_gpt.py")
COMMON = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-cpu-initialization",
          "--train-iters", "8", "--attention-dropout", "0", "--log-interval", "4"]


def _train(tmp_path, name: str, extra: list[str]) -> tuple[list[float], str]:
    summary = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), EXAMPLE, *COMMON, "--summary-json", str(summary), *extra]
    env = {k: v for k, v in os.environ.items() if k != "NPUSPEED_ARGS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(summary.read_text())["losses"], proc.stdout + proc.stderr


def test_tp2_sp_flash_attn_matches_unfused(tmp_path):
    base, base_log = _train(tmp_path, "unfused", [])
    fused, log = _train(tmp_path, "fused", ["--use-flash-attn"])
    applied = re.compile(r"features=\S*\bfused_attention\b")
    assert applied.search(log) and not applied.search(base_log), "--use-flash-attn was not applied"
    assert len(base) == len(fused) == 8
    diffs = [abs(a - b) for a, b in zip(base, fused)]
    assert max(diffs) <= 1e-4, f"loss differences {diffs}"
    assert fused[-1] < fused[0], "loss did not fall"
