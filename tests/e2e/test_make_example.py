"""`make example`, the first thing a newcomer runs: the Makefile's own model and flags train, and
the run's own report (`npuspeed report --run`) shows every feature on with its path, the
counters of what ran, and tokens/s and peak memory against a run without the flags."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from launch import ROOT, run_example
from tiers import pinned

NPUSPEED = os.path.join(os.path.dirname(sys.executable), "npuspeed")
# make's variables as the Makefile spells them (continuation lines joined)
_MAKEFILE = (ROOT / "Makefile").read_text().replace("\\\n", " ")


def make_var(name: str) -> list[str]:
    found = re.search(rf"^{name} \?=(.*)$", _MAKEFILE, re.M)
    assert found, f"{name} is not set in the Makefile"
    return found.group(1).split()


def cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [NPUSPEED] if os.path.exists(NPUSPEED) else [sys.executable, "-m", "npuspeed.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=300, env=pinned(dict(os.environ)))


def test_make_example_flags_train_and_report_themselves(tmp_path):
    # the Makefile's model and flags, shortened (argparse keeps the last value of a repeated flag)
    short = ["--train-iters", "3", "--seq-length", "128", "--max-position-embeddings", "128", "--log-interval", "1"]
    base = run_example(make_var("EXAMPLE_MODEL") + short, tmp_path, nproc=2, name="baseline")
    run = run_example(make_var("EXAMPLE_MODEL") + make_var("EXAMPLE_FLAGS") + short, tmp_path, nproc=2, name="run")
    report = run["npuspeed_report"]
    on = {f["name"] for f in report["features"] if f["enabled"]}
    assert {"fused_attention", "fused_rmsnorm", "fused_swiglu", "fused_rotary_pos_emb", "fused_linear_ce"} <= on, on
    # no flag, no feature: only those on without one (the device's, and Megatron-LM's integration where
    # megatron.training imports, as megatron-core 0.19's wheel ships it on Python 3.12)
    from npuspeed.features.megatron_lm.megatron_lm_feature import megatron_lm_present

    unflagged = {"device"} | ({"megatron_lm"} if megatron_lm_present() else set())
    assert not {f["name"] for f in base["npuspeed_report"]["features"] if f["enabled"]} - unflagged
    assert any(k.startswith("ops.rms_norm.") for k in report["counters"]), report["counters"]  # it ran, per shape
    assert report["fused_op_choices"], "the run's own chooser records are in its report"

    proc = cli("report", "--run", str(tmp_path / "run.json"), "--baseline", str(tmp_path / "baseline.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "fused op choices" in out and "counters (what ran, how often):" in out
    assert re.search(r"with the flags: \d+\.\d\dx the tokens/s and \d+\.\d\dx the peak memory", out), out[-2000:]
    assert "patch target" not in out and "npuspeed report --patches" in out  # the long table is behind a flag
    as_json = json.loads(cli("report", "--run", str(tmp_path / "run.json"), "--baseline",
                             str(tmp_path / "baseline.json"), "--json").stdout)
    cmp = as_json["comparison"]
    assert cmp["tokens_per_s_ratio"] == run["tokens_per_s"] / base["tokens_per_s"]
    assert cmp["peak_mem_ratio"] == run["peak_mem_bytes"] / base["peak_mem_bytes"]
