"""A rank killed mid-step or mid-save, or hung: the other rank stops with one clear line (at
once when the peer's process is gone, within the collective timeout, here 10 s, when it
hangs), never hangs itself, and the last complete checkpoint resumes bit for bit. Ranks are started as srun/mpirun do (tests/ranks.py), with no torchrun agent
to stop the survivors: their own behaviour is what is tested. 2 gloo ranks, TP2.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import ranks
from launch import EXAMPLE, TINY, run_example

RUNNER = Path(__file__).with_name("_fault_runner.py")
ARGS = TINY + ["--tensor-model-parallel-size", "2", "--train-iters", "6", "--save-interval", "2"]
# The timeout bounds every wait on a peer, start-up included (as Megatron-LM's): a few seconds,
# but more than a loaded 2-core machine can make one rank lag behind the other.
HUNG_TIMEOUT = ["--distributed-timeout-minutes", str(10 / 60)]
KILL_TIMEOUT = ["--distributed-timeout-minutes", "1"]  # never reached: a dead peer's sockets close
HANG_GUARD_S = 240  # far above both: only a hang reaches it


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (same flags, saving every 2 iterations)."""
    tmp = tmp_path_factory.mktemp("reference")
    return run_example(ARGS + ["--save", str(tmp / "ckpt")], tmp, nproc=2, name="reference")


def _faulty(fault: str, ckpt: Path, timeout=KILL_TIMEOUT) -> list[ranks.Rank]:
    started = ranks.start(RUNNER, ARGS + timeout + ["--save", str(ckpt)], 2, env={"NPUSPEED_TEST_FAULT": fault})
    return ranks.wait(started, HANG_GUARD_S)


def _survivor_line(rank: ranks.Rank) -> str:
    assert rank.rc == 1, rank.err[-3000:]
    assert "Traceback" not in rank.err, rank.err[-3000:]
    lines = [line for line in rank.err.splitlines() if line.startswith("npuspeed: error: ")]
    assert len(lines) == 1, rank.err[-3000:]
    return lines[0]


def _resume_matches(reference, ckpt: Path, tmp_path, last: int) -> None:
    resumed = run_example(ARGS + ["--save", str(ckpt), "--load", str(ckpt)], tmp_path, nproc=2, name="resumed")
    assert resumed["first_iteration"] == last + 1
    assert resumed["losses"] == reference["losses"][last:]


def test_rank_killed_mid_step(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    survivor, killed = _faulty("kill-in-step:1:7", ckpt)  # iteration 4, first micro-batch
    assert killed.rc == -9
    line = _survivor_line(survivor)
    assert line.startswith("npuspeed: error: rank 0: iteration 4: a collective failed because another rank "
                           "died or did not answer within the timeout (60 s, --distributed-timeout-minutes)")
    assert line.endswith(f"the last complete checkpoint is iteration 2 in {ckpt}: restart with --load {ckpt}")
    _resume_matches(reference, ckpt, tmp_path, last=2)


def test_rank_hung_mid_step_times_out(tmp_path):
    survivor, stopped = _faulty("stop-in-step:1:3", tmp_path / "ckpt", HUNG_TIMEOUT)  # iteration 2
    assert stopped.rc == -9  # SIGSTOPped, then killed by the test once the survivor had left
    line = _survivor_line(survivor)
    assert "rank 0: iteration 2: a collective failed" in line and "(10 s," in line, line
    assert "Timed out" in line  # gloo's own words: the timeout, not a closed connection
    assert line.endswith(f"no checkpoint was completed in {tmp_path / 'ckpt'}")


def test_rank_killed_mid_save(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    survivor, killed = _faulty("kill-in-save:1:4", ckpt)
    assert killed.rc == -9
    line = _survivor_line(survivor)
    assert line.startswith("npuspeed: error: rank 0: while saving the checkpoint of iteration 4: a collective "
                           "failed")
    assert line.endswith(f"the last complete checkpoint is iteration 2 in {ckpt}: restart with --load {ckpt}")
    # the interrupted save left its partial files aside; the tracker still names iteration 2
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not (ckpt / "iter_0000004").exists()
    partial = ckpt / "iter_0000004.tmp"
    assert partial.is_dir() and not (partial / ".metadata").exists()
    _resume_matches(reference, ckpt, tmp_path, last=2)
    assert (ckpt / "iter_0000004" / ".metadata").is_file() and not partial.exists()  # re-saved whole
    assert EXAMPLE.exists()
