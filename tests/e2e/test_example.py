"""The README's example, as a newcomer runs it, plus the start-up errors a user can meet."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from launch import ROOT, run_example
from tiers import pinned

README_ARGS = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-cpu-initialization",
               "--lr", "3e-3"]


def test_readme_example_trains(tmp_path):
    run = run_example(README_ARGS + ["--train-iters", "10", "--log-throughput"], tmp_path, nproc=2)
    losses = run["losses"]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses
    assert run["world_size"] == 2 and run["peak_mem_bytes"] > 0
    # where the parameters and the batches the model got live (the device tier checks the accelerator)
    assert run["param_devices"] == ["cpu"] and run["batch_devices"] == ["cpu"], (run["param_devices"], run["batch_devices"])
    assert run["tokens_per_s"] > 0 and run["mean_step_ms"] > 0
    assert len(run["step_ms"]) == 10 and min(run["step_ms"][1:]) <= run["median_step_ms"] <= max(run["step_ms"][1:])
    cpu = run["median_step_cpu_ms_per_rank"]  # every rank's median step CPU time, in rank order
    assert len(cpu) == 2 and all(x > 0 for x in cpu)
    assert "elapsed time per iteration (ms)" in run["log"] and "lm loss" in run["log"]
    # TFLOP/s per rank: Megatron-LM's count (vocabulary 258 padded to 128 x TP) over the mean step and 2 ranks
    from megatron_flops_by_hand import megatron_args, megatron_by_hand

    hand = megatron_by_hand(megatron_args(padded_vocab_size=512), 2)  # default batch: 1 micro-batch of 2
    assert run["tflops_per_s_per_rank"] == pytest.approx(hand / (run["mean_step_ms"] / 1e3) / 2 / 1e12, rel=0.01)
    assert run["device_peak_tflops"] is None and run["mfu"] is None  # CPU: no peak unless given
    assert run["log"].count("throughput per GPU (TFLOP/s/GPU): ") == 10
    # the step's two parts (what `npuspeed plan` predicts apart) add up to less than the step
    for i, step in enumerate(run["step_ms"]):
        fb, opt = run["forward_backward_ms"][i], run["optimizer_step_ms"][i]
        assert fb > 0 and opt > 0 and fb + opt <= step


def test_indexed_dataset_trains(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"document {i}: " + "the quick brown fox " * 20})
                                for i in range(64)))
    prefix = tmp_path / "corpus"
    subprocess.run([sys.executable, str(ROOT / "examples" / "preprocess_data.py"), "--input", str(corpus),
                    "--output-prefix", str(prefix), "--append-eod"], check=True, cwd=ROOT,
                   capture_output=True)
    data = f"{prefix}_text_document"
    run = run_example(["--data-path", data, "--data-cache-path", str(tmp_path / "cache"),
                       "--train-iters", "6", "--lr", "3e-3"], tmp_path, nproc=1)
    assert run["losses"][-1] < run["losses"][0]


def test_tp_not_dividing_world_size_is_one_line(tmp_path):
    try:
        run_example(["--tensor-model-parallel-size", "3", "--train-iters", "1"], tmp_path, nproc=2)
    except AssertionError as exc:
        message = str(exc)
    else:
        raise AssertionError("TP=3 on 2 ranks must fail")
    # refused before Megatron's own RuntimeError, as one line (tests/unit/test_bad_input_table.py)
    assert "npuspeed: error: world size 2 is not divisible by --tensor-model-parallel-size 3" in message
    assert "[rank0]: Traceback" not in message and "[rank1]: Traceback" not in message


def test_importing_adaptor_after_megatron_warns_and_works():
    code = ("import megatron.core.tensor_parallel; import npuspeed.megatron_adaptor, torch; "
            "print('device', torch.cuda.current_device())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=pinned({"PYTHONWARNINGS": "ignore", "PATH": "/usr/bin:/bin"}))
    assert proc.returncode == 0, proc.stderr
    assert "imported before npuspeed.megatron_adaptor" in proc.stderr
    assert "device cpu" in proc.stdout


def test_deterministic_mode_with_documents_on_the_unfused_path(tmp_path):
    """--deterministic-mode is set up by the adaptor (said once in the log) and in force in
    the run; packed documents without --use-flash-attn train on the example's document mask."""
    args = ["--deterministic-mode", "--reset-attention-mask", "--reset-position-ids", "--mock-document-length", "16",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "3", "--use-cpu-initialization"]
    run = run_example(args, tmp_path, nproc=1)
    assert run["deterministic_mode"] is True
    assert "--deterministic-mode: deterministic algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8" in run["log"]
    assert all(math.isfinite(x) for x in run["losses"])
    plain = run_example(args[1:], tmp_path, nproc=1, name="plain")
    assert plain["deterministic_mode"] is False
    # torch's deterministic variants (e.g. of the embedding's index_add backward) sum in
    # another order: the same training, not the same bits
    assert max(abs(a - b) for a, b in zip(plain["losses"], run["losses"])) < 1e-4
