"""--npuspeed-dump through the example as a user runs it, and `npuspeed compare` on the dumps:
the dump leaves the losses bitwise unchanged; the same configuration twice: no divergence; TP1
against TP2 + sequence parallelism (fp32, 2 gloo ranks): no module flagged, every module compared
after reassembly; a 1e-3 relative error injected into layer 2's norm forward by a test-only runner
(_example_with_norm_fault.py): named there, forward, at the first step. Each run is a torchrun of
the tiny model (~20-40 s on the shared 2-core CI host): slow."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import NO_DROPOUT, ROOT, TINY, run_example

pytestmark = pytest.mark.slow
SHAPE = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--train-iters", "3"] + TINY + NO_DROPOUT
DUMP = ["--dump-steps", "1,2", "--dump-level", "tensors"]
FAULT = Path(__file__).with_name("_example_with_norm_fault.py")


def _compare(a, b) -> dict:
    proc = subprocess.run([sys.executable, "-m", "npuspeed.cli", "compare", str(a), str(b), "--json", "--no-plot"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp1")
    summary = run_example(SHAPE + DUMP + ["--npuspeed-dump", str(tmp / "dump")], tmp, name="tp1")
    return tmp / "dump", summary


def test_dump_leaves_losses_bitwise_and_the_same_run_twice_does_not_diverge(tp1, tmp_path):
    plain = run_example(SHAPE, tmp_path, name="plain")
    assert plain["losses"] == tp1[1]["losses"]
    dump = next(f for f in tp1[1]["npuspeed_report"]["features"] if f["name"] == "dump")
    assert dump["enabled"] and "records written in this process: " in dump["path"]  # the path ran
    assert int(dump["path"].rsplit(": ", 1)[1]) > 0 and tp1[1]["npuspeed_counters"].get("dump.records", 0) > 0
    again = run_example(SHAPE + DUMP + ["--npuspeed-dump", str(tmp_path / "again")], tmp_path, name="again")
    got = _compare(tp1[0], tmp_path / "again")
    assert got["divergence"] is None and got["steps_compared"] == [1, 2] and got["max_rel_error"] == 0.0
    assert again["losses"] == tp1[1]["losses"]


def test_tp1_against_tp2_sequence_parallel_flags_no_module(tp1, tmp_path):
    run_example(SHAPE + DUMP + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--npuspeed-dump", str(tmp_path / "tp2")], tmp_path, nproc=2, name="tp2")
    got = _compare(tp1[0], tmp_path / "tp2")
    assert got["divergence"] is None, got["divergence"]
    assert 0.0 < got["max_rel_error"] < 1e-4  # a different reduction order, within fp32's tolerance
    assert got["notes"] == []  # every slot of A found in B and compared
    # compared, not skipped: the reassembled slots include the column-parallel, SP and partial-sum kinds
    assert all(r["rel_diff"] < 1e-5 for r in got["losses"])


def test_injected_norm_error_is_named_at_layer_2_norm_forward(tp1, tmp_path):
    run_example(SHAPE + DUMP + ["--npuspeed-dump", str(tmp_path / "fault")], tmp_path, name="fault", script=FAULT,
                env={"NPUSPEED_TEST_NORM_FAULT": "1e-3"})
    div = _compare(tp1[0], tmp_path / "fault")["divergence"]
    assert div["step"] == 1
    forward = div["forward"]
    assert (forward["module"], forward["direction"], forward["micro_batch"]) == ("decoder.layers.1.input_layernorm",
                                                                                  "forward", 0)
    assert forward["rel_error"] == pytest.approx(1e-3, rel=0.05)
    assert forward["before"] and all(b["rel_error"] <= b["tolerance"] for b in forward["before"])
