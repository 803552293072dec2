"""The example, Llama-style (RMSNorm, SwiGLU, RoPE), at TP2 + sequence parallel: with
--use-fused-rmsnorm --use-fused-swiglu --use-fused-rotary-pos-emb it matches the run without
them (fp32, 8 iterations, |loss difference| <= 1e-4 at every iteration), every rank ran the
C++ kernels and not the references, and the run without the flags ran none of them.
A third run with NPUSPEED_DISABLE_CPP=1 (no compiled library) still trains, on Megatron's path.
NPUSPEED_FUSED_OP_PATH=npuspeed forces the kernels (the per-shape measurement is tested in unit).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNNER = os.path.join(ROOT, "tests", "distributed", "_example_with_tally.py")
LLAMA = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-cpu-initialization",
         "--train-iters", "8", "--log-interval", "4", "--normalization", "RMSNorm", "--swiglu",
         "--position-embedding-type", "rope", "--disable-bias-linear", "--attention-dropout", "0"]
FLAGS = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb"]
OPS = ("rms_norm", "swiglu", "rotary_pos_emb")


@pytest.fixture(scope="module", autouse=True)
def _force_npuspeed_kernels():
    """These runs test npuspeed's kernels (their counters are asserted): force them instead of the
    per-shape measurement, which may pick Megatron's path on a tiny model (tests/unit/test_*choice*)."""
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setenv("NPUSPEED_FUSED_OP_PATH", "npuspeed")
        yield


def _train(tmp_path, name: str, extra: list[str], env_extra: dict | None = None):
    summary, tally = tmp_path / f"{name}.json", tmp_path / f"{name}.tally"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), RUNNER, *LLAMA, "--summary-json", str(summary),
           "--tally-json", str(tally), *extra]
    env = {k: v for k, v in os.environ.items() if k != "NPUSPEED_ARGS"}
    env.update(env_extra or {})
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    tallies = [json.loads((tmp_path / f"{name}.tally.rank{r}").read_text()) for r in (0, 1)]
    return json.loads(summary.read_text())["losses"], tallies, proc.stdout + proc.stderr


def test_tp2_sp_fused_ops_match_unfused(tmp_path):
    from npuspeed.ops._extension import has_op

    if not has_op("rms_norm"):
        pytest.skip("C++ op library not built here")
    base, base_tally, _ = _train(tmp_path, "unfused", [])
    fused, tally, log = _train(tmp_path, "fused", FLAGS)
    assert "features=device,fused_rmsnorm,fused_swiglu,fused_rotary_pos_emb" in log.replace(" ", "")
    assert all(t == {} for t in base_tally), base_tally
    for t in tally:
        assert all(t.get(f"{op}:cpp", 0) > 0 for op in OPS), t
        assert not any(k.endswith(":reference") for k in t), t
    assert len(base) == len(fused) == 8
    diffs = [abs(a - b) for a, b in zip(base, fused)]
    assert max(diffs) <= 1e-4, f"loss differences {diffs}"
    assert fused[-1] < fused[0], "loss did not fall"

    ref, ref_tally, ref_log = _train(tmp_path, "disabled", FLAGS, {"NPUSPEED_DISABLE_CPP": "1"})
    for t in ref_tally:  # no C++ kernel: the flags run Megatron's own path, and say so
        assert all(t.get(f"{op}:megatron", 0) > 0 for op in OPS) and not any(k.endswith(":cpp") for k in t), t
    assert "no npuspeed kernel" in ref_log
    assert max(abs(a - b) for a, b in zip(base, ref)) <= 1e-4
