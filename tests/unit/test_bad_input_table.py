"""A table of bad inputs: each ends in one `npuspeed: error:` line naming the flag and the
fix, exit status 2, no traceback; rank 0 alone prints it; NPUSPEED_DEBUG=1 shows the traceback.

Most rows fail before any process group starts, so they run in one process: a fork server
(tests/_forked_example.py) imports torch once and forks a child per row that runs
examples/pretrain_gpt.py as `python examples/pretrain_gpt.py ...` would. WORLD_SIZE / RANK
stand in for the launcher. A few rows go through a real interpreter and torchrun as well.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from forked import error_lines, run_rows
from launch import ROOT, free_port
from tiers import pinned

from packaging.version import Version

from npuspeed.patching.versions import megatron_version

W2 = {"WORLD_SIZE": "2"}


def _cuda_really_present() -> bool:
    """torch's own answer (the accelerator layer keeps it from before the CPU shim)."""
    from npuspeed.accelerator import _cuda_present

    return _cuda_present()


# (id, argv, env, expected text of the line after "npuspeed: error: ")
NPUSPEED_ROWS = [
    ("fp8-recipe-alone", ["--fp8-recipe", "tensorwise"], {},
     "--fp8-recipe tensorwise is given without --fp8-format"),
    ("fp8-delayed-first-last-bf16", ["--fp8-format", "hybrid", "--first-last-layers-bf16"], {},
     "--first-last-layers-bf16 with --fp8-recipe delayed: Megatron refuses this pair"),
    ("recompute-norm-num-alone", ["--recompute-norm-num-layers", "2"], {},
     "--recompute-norm-num-layers 2 is given without --recompute-norm"),
    ("swap-modules-unknown", ["--swap-attention", "--swap-modules", "attn"], {},
     "--swap-modules 'attn': unknown module attn"),
    ("adaptive-too-small", ["--adaptive-recompute-device-size", "1", "--num-layers", "2", "--hidden-size", "64",
                            "--num-attention-heads", "4", "--seq-length", "128"], {},
     "--adaptive-recompute-device-size 1: nothing fits"),
    ("adaptive-without-shape", ["--adaptive-recompute-device-size", "100"], {},
     "--adaptive-recompute-device-size plans the run from its flags: npuspeed plan needs --num-layers"),
    ("adaptive-with-swap", ["--adaptive-recompute-device-size", "500", "--swap-attention"], {},
     "--swap-attention with --adaptive-recompute-device-size"),
    ("adaptive-with-recompute", ["--adaptive-recompute-device-size", "500", "--recompute-norm"], {},
     "--adaptive-recompute-device-size chooses recompute itself: drop --recompute-norm"),
    ("reuse-with-fp16", ["--reuse-fp32-param", "--fp16"], {}, "--reuse-fp32-param works with --bf16 only"),
    ("swap-optimizer-with-cpu-offload", ["--swap-optimizer", "--optimizer-cpu-offload"], {},
     "--swap-optimizer with --optimizer-cpu-offload: both move optimizer state to the host; pick one"),
    ("offload-fraction-outside", ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5"], {},
     "--optimizer-offload-fraction 1.5 is outside (0, 1]"),
    ("offload-fraction-zero", ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0"], {},
     "--optimizer-offload-fraction 0 is outside (0, 1]"),
    ("cpu-offload-without-te", ["--optimizer-cpu-offload"], {},
     f"--optimizer-cpu-offload: megatron-core {megatron_version()} runs its hybrid optimizer only on the "
     "--use-precision-aware-optimizer path"),
    ("swap-optimizer-chunk-zero", ["--swap-optimizer", "--swap-optimizer-chunk-mb", "0"], {},
     "--swap-optimizer-chunk-mb must be a positive number of MiB"),
    ("coc-without-num", ["--use-coc", "--tensor-model-parallel-size", "2"], W2,
     "--use-coc needs --coc-parallel-num N with N > 1"),
    ("coc-num-alone", ["--coc-parallel-num", "4"], {}, "--coc-parallel-num 4 is given without --use-coc; add --use-coc"),
    ("coc-at-tp1", ["--use-coc", "--coc-parallel-num", "2"], {}, "--use-coc overlaps tensor-parallel communication"),
    ("coc-num-not-int", ["--use-coc", "--coc-parallel-num", "two"], {},
     "argument --coc-parallel-num: invalid int value: 'two'"),
    ("recompute-num-alone", ["--recompute-activation-function-num-layers", "1"], {},
     "--recompute-activation-function-num-layers 1 is given without --recompute-activation-function"),
    ("dump-steps-bad", ["--npuspeed-dump", "dumps/a", "--dump-steps", "0"], {},
     "--dump-steps 0: give 1-based iterations and ranges, e.g. --dump-steps 1,3-5"),
    ("dump-level-alone", ["--dump-level", "tensors"], {}, "--dump-level tensors is given without --npuspeed-dump"),
    ("sparse-mode-alone", ["--sparse-mode", "2"], {}, "--sparse-mode 2 is given without --use-flash-attn; add --use-flash-attn"),
    ("device-flag-unknown", ["--npuspeed-device", "tpu"], {},
     "argument --npuspeed-device: invalid choice: 'tpu'"),
    ("device-flag-npu", ["--npuspeed-device", "npu"], {}, "NPUSPEED_DEVICE=npu needs torch_npu"),
    ("device-env-npu", [], {"NPUSPEED_DEVICE": "npu"}, "pip install npuspeed[npu]"),
    ("device-env-cuda", [], {"NPUSPEED_DEVICE": "cuda"}, "NPUSPEED_DEVICE=cuda but this torch build sees no CUDA"),
    ("device-env-unknown", [], {"NPUSPEED_DEVICE": "tpu"}, "NPUSPEED_DEVICE='tpu' is not a known device"),
    ("cpu-cache-env", [], {"NPUSPEED_CPU_CACHE_MB": "lots"}, "NPUSPEED_CPU_CACHE_MB='lots' is not a number of MiB"),
    # found when the optimizer is built (the fp32 run has no masters to share): still one line
    ("reuse-in-fp32", ["--reuse-fp32-param"], {}, "--reuse-fp32-param shares the fp32 master weights with bf16 "
                                                  "parameters, but this run trains in fp32"),
    ("env-args-typo", [], {"NPUSPEED_ARGS": "--reuse-fp32-params"},
     "NPUSPEED_ARGS: unrecognized argument --reuse-fp32-params; did you mean --reuse-fp32-param?"),
    # Megatron's own features (0.14-0.19) that do what an npuspeed flag does (features/upstream_flags.py)
    ("recompute-modules-layernorm", ["--recompute-norm", "--recompute-granularity", "selective",
                                     "--recompute-modules", "core_attn", "layernorm"], {},
     "--recompute-norm with Megatron's --recompute-modules layernorm: both recompute the norms' outputs; pick one"),
    ("recompute-modules-moe-act", ["--recompute-activation-function", "--recompute-granularity", "selective",
                                   "--recompute-modules", "moe_act"], {},
     "--recompute-activation-function with Megatron's --recompute-modules moe_act"),
    ("ep-overlap-twice", ["--moe-alltoall-overlap-comm", "--overlap-moe-expert-parallel-comm"], {},
     "--moe-alltoall-overlap-comm with Megatron's --overlap-moe-expert-parallel-comm"),
    # --moe-fb-overlap: what the paired schedule cannot compose with
    ("fb-overlap-with-chunks", ["--moe-fb-overlap", "--moe-alltoall-overlap-comm"], {},
     "--moe-fb-overlap hides the all-to-all behind another micro-batch; --moe-alltoall-overlap-comm"),
    ("fb-overlap-allgather", ["--moe-fb-overlap", "--moe-token-dispatcher-type", "allgather"], {},
     "--moe-fb-overlap overlaps the all-to-all dispatcher; --moe-token-dispatcher-type is allgather"),
    ("fb-overlap-ep1", ["--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size", "1"], {},
     "--overlap-moe-expert-parallel-comm: expert-parallel size is 1"),
    ("fb-overlap-pp2-without-vpp", ["--moe-fb-overlap", "--pipeline-model-parallel-size", "2"], {},
     "--moe-fb-overlap at --pipeline-model-parallel-size 2 " + (
         "pairs micro-batches in Megatron's interleaved schedule, as Megatron's own combined 1F1B does: add "
         "--num-layers-per-virtual-pipeline-stage" if megatron_version() >= Version("0.14") else
         "runs on the interleaved schedule's extra warm-up micro-batch, which megatron-core 0.14+ has")),
    ("fb-overlap-vpp-batch", ["--overlap-moe-expert-parallel-comm", "--pipeline-model-parallel-size", "2",
                              "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "4",
                              "--micro-batch-size", "1"], {"WORLD_SIZE": "4"},
     "--overlap-moe-expert-parallel-comm at --pipeline-model-parallel-size 2 " + (
         "with VPP runs one extra warm-up micro-batch, so it needs more micro-batches a step than pipeline "
         "stages (2 <= 2): raise --global-batch-size" if megatron_version() >= Version("0.14") else
         "runs on the interleaved schedule's extra warm-up micro-batch")),
    ("fb-overlap-full-recompute", ["--moe-fb-overlap", "--recompute-granularity", "full"], {},
     "--moe-fb-overlap: full recompute re-runs the layer's all-to-alls"),
    # --schedules-method dualpipev: what its V placement needs
    ("dualpipev-pp1", ["--schedules-method", "dualpipev"], {},
     "--schedules-method dualpipev places two chunks per pipeline rank in a V: it needs "
     "--pipeline-model-parallel-size 2 or more"),
    ("dualpipev-old-release" if megatron_version() < Version("0.14") else "dualpipev-no-vpp",
     ["--schedules-method", "dualpipev", "--pipeline-model-parallel-size", "2", "--num-layers", "4"], {},
     "--schedules-method dualpipev builds its V from megatron-core 0.14+'s per-chunk layer offsets"
     if megatron_version() < Version("0.14") else
     "--schedules-method dualpipev builds two model chunks per pipeline rank: add "
     "--num-layers-per-virtual-pipeline-stage 1 (num-layers / (2 x PP))"),
    *([("dualpipev-tied", ["--schedules-method", "dualpipev", "--pipeline-model-parallel-size", "2", "--num-layers",
                           "4", "--num-layers-per-virtual-pipeline-stage", "1"], {},
        "--schedules-method dualpipev puts the embedding and the output layer on rank 0 in two chunks; add "
        "--untie-embeddings-and-output-weights"),
       ("dualpipev-batch", ["--schedules-method", "dualpipev", "--pipeline-model-parallel-size", "2", "--num-layers",
                            "4", "--num-layers-per-virtual-pipeline-stage", "1", "--untie-embeddings-and-output-weights",
                            "--global-batch-size", "3", "--micro-batch-size", "1"], {"WORLD_SIZE": "2"},
        "--schedules-method dualpipev at --pipeline-model-parallel-size 2 needs at least 2 x 2 = 4 micro-batches a "
        "step (got 3)")] if megatron_version() >= Version("0.14") else []),
    ("activation-offload-with-swap", ["--swap-attention", "--fine-grained-activation-offloading"], {},
     "--swap-attention with Megatron's --fine-grained-activation-offloading"),
    ("layer-wise-optimizer-with-swap", ["--swap-optimizer", "--optimizer", "muon"], {},
     "--swap-optimizer with Megatron's --optimizer muon: Megatron then builds its layer-wise distributed optimizer"),
    ("layer-wise-optimizer-with-reuse", ["--reuse-fp32-param", "--bf16", "--optimizer", "dist_muon"], {},
     "--reuse-fp32-param with Megatron's --optimizer dist_muon"),
    ("layout-with-adaptive", ["--adaptive-recompute-device-size", "500", "--num-layers", "2", "--hidden-size", "64",
                              "--num-attention-heads", "4", "--seq-length", "128",
                              "--pipeline-model-parallel-layout", "Et|tL"], {},
     "--pipeline-model-parallel-layout: the planner models"),
    ("cuda-graph-with-fused", ["--use-fused-rmsnorm", "--normalization", "RMSNorm", "--cuda-graph-impl", "local"], {},
     "--use-fused-rmsnorm with Megatron's --cuda-graph-impl local: a captured graph replays kernels"),
    ("enable-cuda-graph", ["--use-flash-attn", "--enable-cuda-graph"], {},
     "--use-flash-attn with Megatron's --enable-cuda-graph"),
    ("gtp-with-coc", ["--use-coc", "--coc-parallel-num", "2", "--tensor-model-parallel-size", "2",
                      "--tensor-parallel-num-weight-shards", "4"], W2,
     "--use-coc with Megatron's --tensor-parallel-num-weight-shards 4: GTP re-shards"),
]
if _cuda_really_present():  # NPUSPEED_DEVICE=cuda is then no error (the CPU tier runs on a GPU host too)
    NPUSPEED_ROWS = [row for row in NPUSPEED_ROWS if row[0] != "device-env-cuda"]

EXAMPLE_ROWS = [
    ("seq-over-positions", ["--seq-length", "128", "--max-position-embeddings", "64"], {},
     "--seq-length 128 is longer than --max-position-embeddings 64: raise --max-position-embeddings"),
    ("gbs-not-multiple", ["--global-batch-size", "6", "--micro-batch-size", "4"], {},
     "--global-batch-size 6 is not a multiple of --micro-batch-size 4 x data-parallel size 1"),
    ("gbs-vs-dp", ["--global-batch-size", "2", "--micro-batch-size", "2"], W2,
     "--global-batch-size 2 is not a multiple of --micro-batch-size 2 x data-parallel size 2 = 4"),
    ("mbs-zero", ["--micro-batch-size", "0"], {}, "--micro-batch-size 0 must be > 0"),
    ("overlap-p2p-without-vpp", ["--overlap-p2p-comm", "--pipeline-model-parallel-size", "2", "--num-layers", "2"],
     W2, "--overlap-p2p-comm overlaps the interleaved schedule's sends and receives: add "
         "--num-layers-per-virtual-pipeline-stage"),
    ("world-vs-tp", ["--tensor-model-parallel-size", "4"], W2,
     "world size 2 is not divisible by --tensor-model-parallel-size 4"),
    ("world-vs-tp-pp", ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
     {"WORLD_SIZE": "6"}, "world size 6 is not divisible by --tensor-model-parallel-size 2 x --pipeline-model"),
    ("heads-vs-tp", ["--tensor-model-parallel-size", "2", "--num-attention-heads", "3", "--hidden-size", "48"], W2,
     "--num-attention-heads 3 is not a multiple of --tensor-model-parallel-size 2"),
    ("hidden-vs-heads", ["--hidden-size", "66"], {},
     "--hidden-size 66 is not divisible by --num-attention-heads 4: change one, or set --kv-channels"),
    ("groups-vs-tp", ["--tensor-model-parallel-size", "2", "--group-query-attention", "--num-query-groups", "1"],
     W2, "--num-query-groups 1 is not a multiple of --tensor-model-parallel-size 2"),
    ("heads-vs-groups", ["--group-query-attention", "--num-query-groups", "3"], {},
     "--num-attention-heads 4 is not a multiple of --num-query-groups 3"),
    ("gqa-without-groups", ["--group-query-attention"], {}, "--group-query-attention needs --num-query-groups N"),
    ("ffn-vs-tp", ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "255"], W2,
     "--ffn-hidden-size 255 is not divisible by --tensor-model-parallel-size 2"),
    ("vocab-multiple-zero", ["--make-vocab-size-divisible-by", "0"], {}, "--make-vocab-size-divisible-by 0 must be > 0"),
    ("null-tokenizer-no-vocab", ["--tokenizer-type", "NullTokenizer"], {},
     "--tokenizer-type NullTokenizer needs --vocab-size N"),
    ("vocab-size-not-null", ["--vocab-size", "100"], {}, "--vocab-size is only used with --tokenizer-type NullTokenizer"),
    ("layers-vs-pp", ["--pipeline-model-parallel-size", "2", "--num-layers", "3"], W2,
     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    ("vpp-without-pp", ["--num-layers-per-virtual-pipeline-stage", "1"], {},
     "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"),
    ("vpp-not-dividing", ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                          "--num-layers-per-virtual-pipeline-stage", "3"], W2,
     "--num-layers-per-virtual-pipeline-stage 3 does not divide the 2 layers of each pipeline stage"),
    ("seq-vs-tp-sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "63"], W2,
     "--sequence-parallel splits --seq-length 63 over --tensor-model-parallel-size 2"),
    ("ep-without-experts", ["--expert-model-parallel-size", "2"], W2,
     "--expert-model-parallel-size 2 needs --num-experts"),
    ("experts-vs-ep", ["--expert-model-parallel-size", "2", "--num-experts", "3"], W2,
     "--num-experts 3 is not a multiple of --expert-model-parallel-size 2"),
    ("topk-over-experts", ["--num-experts", "2", "--moe-router-topk", "3"], {},
     "--moe-router-topk 3 is more than --num-experts 2"),
    ("param-gather-no-distopt", ["--overlap-param-gather", "--overlap-grad-reduce"], {},
     "--overlap-param-gather needs --use-distributed-optimizer"),
    ("bf16-and-fp16", ["--bf16", "--fp16"], {}, "--bf16 and --fp16 exclude each other: pick one"),
    ("peak-tflops-zero", ["--device-peak-tflops", "0"], {}, "--device-peak-tflops 0.0 must be > 0"),
    ("min-lr-over-lr", ["--lr", "0.001", "--min-lr", "0.01"], {}, "--min-lr 0.01 is above --lr 0.001"),
    ("selective-with-method", ["--recompute-granularity", "selective", "--recompute-method", "uniform"], {},
     "--recompute-method applies to --recompute-granularity full only"),
    ("full-without-method", ["--recompute-granularity", "full"], {},
     "--recompute-granularity full needs --recompute-method uniform or block"),
    ("ckpt-step-without-load", ["--ckpt-step", "4"], {}, "--ckpt-step needs --load DIR"),
    ("save-interval-zero", ["--save", "ckpt", "--save-interval", "0"], {}, "--save-interval 0 must be > 0"),
    ("timeout-zero", ["--distributed-timeout-minutes", "0"], {}, "--distributed-timeout-minutes 0.0 must be > 0"),
    ("data-path-missing", ["--data-path", "/nonexistent/corpus"], {}, "--data-path /nonexistent/corpus: "
                                                                     "/nonexistent/corpus.bin not found"),
    ("mock-and-data", ["--mock-data", "--data-path", "/nonexistent/corpus"], {},
     "--mock-data and --data-path exclude each other"),
    ("typo-flag", ["--seq-lenght", "64"], {}, "unrecognized arguments: --seq-lenght 64 (see --help"),
    ("bad-choice", ["--normalization", "BatchNorm"], {},
     "argument --normalization: invalid choice: 'BatchNorm' (choose from"),
]


@pytest.fixture(scope="module")
def outcomes():
    """id -> (rc, stdout, stderr) for every row (two fork servers)."""
    results = {}
    for mode, rows in (("fresh", NPUSPEED_ROWS), ("initialized", EXAMPLE_ROWS)):
        for row, out in zip(rows, run_rows(mode, [(argv, env) for _id, argv, env, _msg in rows])):
            results[row[0]] = out
    return results


def test_table_is_large_enough():
    assert len(NPUSPEED_ROWS) + len(EXAMPLE_ROWS) >= 25


@pytest.mark.parametrize("row", NPUSPEED_ROWS + EXAMPLE_ROWS, ids=[r[0] for r in NPUSPEED_ROWS + EXAMPLE_ROWS])
def test_bad_input(row, outcomes):
    ident, argv, _env, expected = row
    out = outcomes[ident]
    both = out["stdout"] + out["stderr"]
    assert out["rc"] == 2, both[-3000:]
    assert "Traceback" not in both, both[-3000:]
    lines = error_lines(out["stderr"])
    assert len(lines) == 1, both[-3000:]
    assert expected in lines[0], lines[0]
    # the line names the flag (or variable) the user has to change
    names = [a for a in argv if a.startswith("--")] + [k for k in _env if k.startswith("NPUSPEED")]
    names += ["NPUSPEED_DEVICE" for a in argv if a == "--npuspeed-device"]  # the flag sets the variable
    assert not names or any(n in lines[0] for n in names), lines[0]


def _python(args, env_extra=None, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for key in ("NPUSPEED_ARGS", "NPUSPEED_DEBUG", "RANK", "WORLD_SIZE"):
        env.pop(key, None)
    pinned(env)  # the CPU tier's backend
    env.update(env_extra or {})
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)


EXAMPLE = str(ROOT / "examples" / "pretrain_gpt.py")


def test_real_interpreter_and_debug_traceback():
    """The same line from a plain `python examples/pretrain_gpt.py`; NPUSPEED_DEBUG=1 shows the traceback."""
    bad = [sys.executable, EXAMPLE, "--seq-length", "128", "--max-position-embeddings", "64"]
    proc = _python(bad)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert error_lines(proc.stderr) == ["npuspeed: error: --seq-length 128 is longer than --max-position-embeddings "
                                         "64: raise --max-position-embeddings to at least 128 or shorten --seq-length"]
    debug = _python(bad, {"NPUSPEED_DEBUG": "1"})
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and "UserError: --seq-length 128" in debug.stderr


def test_non_zero_rank_is_silent():
    proc = _python([sys.executable, EXAMPLE, "--reuse-fp32-param", "--fp16"], {"RANK": "1", "WORLD_SIZE": "2"},
                   timeout=120)
    assert proc.returncode == 2 and not error_lines(proc.stderr) and "Traceback" not in proc.stderr


def test_torchrun_two_ranks_print_one_line():
    """Under torchrun every rank fails; rank 0 prints, and torchrun's summary quotes the line."""
    proc = _python([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                    str(free_port()), EXAMPLE, "--tensor-model-parallel-size", "2", "--num-attention-heads", "3",
                    "--hidden-size", "48"])
    expected = "npuspeed: error: --num-attention-heads 3 is not a multiple of --tensor-model-parallel-size 2"
    lines = error_lines(proc.stdout + proc.stderr)
    assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr[-3000:]
    assert f"traceback : {expected}" in proc.stderr  # torchrun's own summary, from the error file
    assert "File \"" + EXAMPLE not in proc.stderr  # no frame of the script: only torchrun's own


def test_npuspeed_report_bad_flag():
    proc = _python([sys.executable, "-m", "npuspeed.cli", "report", "--use-coc"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert error_lines(proc.stderr) == [l for l in error_lines(proc.stderr) if "--use-coc" in l] != []
