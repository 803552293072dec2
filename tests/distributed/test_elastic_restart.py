"""An elastic restart resumes: the example under torchrun's default launch with `--max-restarts 1`
(`--nproc-per-node 2 --master-port P`, no rendezvous options), a worker SIGKILLed after the
iteration-2 checkpoint in the first attempt only; torchrun restarts both workers, they load that
checkpoint (`--load` = `--save`) and finish, and their losses are the uninterrupted run's, bit for
bit. Without npuspeed's per-restart store prefix (npuspeed/features/device/elastic_restart.py)
the restarted workers' gloo connectFullMesh is refused and the run fails. 2 gloo ranks, TP2.
"""
from __future__ import annotations

from pathlib import Path

from launch import NO_DROPOUT, TINY, run_example

RUNNER = Path(__file__).with_name("_fault_runner.py")
ARGS = TINY + NO_DROPOUT + ["--tensor-model-parallel-size", "2", "--train-iters", "5", "--save-interval", "2",
                            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                            "--seq-length", "64"]


def test_a_worker_killed_after_a_checkpoint_resumes_under_torchrun(tmp_path):
    reference = run_example(ARGS + ["--save", str(tmp_path / "reference")], tmp_path, nproc=2, name="reference")
    ckpt = tmp_path / "ckpt"
    resumed = run_example(ARGS + ["--save", str(ckpt), "--load", str(ckpt)], tmp_path, nproc=2, name="elastic",
                          script=RUNNER, env={"NPUSPEED_TEST_FAULT": "kill-in-first-attempt:1:7"},  # iteration 4
                          torchrun_args=["--max-restarts", "1"])
    log = resumed["log"]
    assert "failed (exitcode: -9) local_rank: 1" in log, log[-3000:]  # torchrun saw the worker killed
    assert "npuspeed: torchelastic restart 1:" in log, log[-3000:]  # and the restart ran with the prefix
    assert resumed["first_iteration"] == 3  # from the iteration-2 checkpoint
    assert len(reference["losses"]) == 5
    assert resumed["losses"] == reference["losses"][2:]
