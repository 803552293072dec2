"""Megatron-LM's own pretrain_gpt.py with the one added import line (CPU, gloo, 2 ranks).

Runs only where NPUSPEED_MEGATRON_LM points at a Megatron-LM checkout at a tag npuspeed knows
(core_v0.16.1 ... core_v0.19.0; `git archive TAG | tar -x -C DIR`). The checkout is not
modified: the entry script is copied next to the test with the import line inserted by
`patch-source`'s own function. Where the installed megatron-core is the checkout's release
(0.19.2's wheel ships megatron.training too) the run uses the installed megatron.core with
the checkout's megatron.training and top-level modules (gpt_builders.py, model_provider.py);
otherwise the whole checkout goes on PYTHONPATH. A small runner
executes it unchanged and then writes npuspeed's report of each rank (features, the C++
op tally, call counts of the patched attention and CoC functions).
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
from packaging.version import Version

from launch import ROOT, free_port
from npuspeed.features.megatron_lm.source_patch import insert_import, known_tag, read_version
from npuspeed.patching.versions import megatron_version

CHECKOUT = os.environ.get("NPUSPEED_MEGATRON_LM", "")
pytestmark = pytest.mark.skipif(
    not (CHECKOUT and (pathlib.Path(CHECKOUT) / "pretrain_gpt.py").is_file()),
    reason="set NPUSPEED_MEGATRON_LM to a Megatron-LM checkout at tag core_v0.16.1 or core_v0.19.0 (e.g. "
           "`git archive core_v0.16.1 | tar -x -C DIR`) to run Megatron-LM's own pretrain_gpt.py")

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 "
        "--train-iters 10 --log-interval 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
        "--eval-iters 0 --eval-interval 1000").split()
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LLAMA = "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear".split()
FEATURES = ("--use-flash-attn --use-fused-rmsnorm --use-fused-swiglu --use-fused-rotary-pos-emb "
            "--recompute-activation-function --use-coc --coc-parallel-num 2").split()

RUNNER = '''\
import collections, json, os, runpy, sys
import torch
import npuspeed.megatron_adaptor  # what the script's own line does first; lets the probes in
from megatron.core.transformer.dot_product_attention import DotProductAttention
from npuspeed.features.coc_overlap.functions import ColumnLinear, RowLinear
PROBES = collections.Counter()
def probe(owner, attr, name):
    raw = owner.__dict__[attr]
    fn = raw.__func__ if isinstance(raw, staticmethod) else raw
    def counted(*a, **k):
        PROBES[name] += 1
        return fn(*a, **k)
    setattr(owner, attr, staticmethod(counted) if isinstance(raw, staticmethod) else counted)
    return fn
PROBES["attention_patched"] = int(bool(getattr(probe(DotProductAttention, "forward", "attention"),
                                               "__npuspeed_patch__", None)))
probe(ColumnLinear, "forward", "coc_column")
probe(RowLinear, "forward", "coc_row")
# Megatron's own features (0.17+): what ran, per rank
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
from megatron.core.transformer.transformer_layer import TransformerLayer
probe(CheckpointWithoutOutput, "checkpoint", "checkpoint_without_output")
probe(TransformerLayer, "forward", "transformer_layer")
for name in ("combined_1f1b_schedule_for_no_pipelining", "combined_1f1b_schedule_for_interleaved_pipelining"):
    if name in schedules.__dict__:
        probe(schedules, name, "combined_1f1b")
script = os.path.abspath(sys.argv[1])
sys.argv = [script] + sys.argv[2:]
try:
    runpy.run_path(script, run_name="__main__")
finally:  # also after Megatron's sys.exit at --exit-interval
    from npuspeed.ops import _dispatch
    from npuspeed.reporting import collect
    data = collect()
    data["calls"] = {f"{op}:{impl}": n for (op, impl), n in _dispatch.calls().items()}
    data["probes"] = dict(PROBES)
    with open(os.environ["REPORT"] + ".rank" + os.environ["RANK"], "w") as fh:
        json.dump(data, fh, default=str)
'''


@pytest.fixture(scope="module", autouse=True)
def _force_npuspeed_kernels():
    """These runs test npuspeed's kernels (their counters are asserted): force them instead of the
    per-shape measurement, which may pick Megatron's path on a tiny model (tests/unit/test_*choice*)."""
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setenv("NPUSPEED_FUSED_OP_PATH", "npuspeed")
        yield


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """pretrain_gpt.py with the import line, next to the runner; the checkout stays as it is."""
    root = pathlib.Path(CHECKOUT).resolve()
    known_tag(read_version(root), root)  # an unknown version fails here, with the reason
    work = tmp_path_factory.mktemp("megatron_lm")
    (work / "path").mkdir()
    if _installed_matches(root):  # the installed megatron.core, the checkout's training and scripts
        (work / "path" / "megatron").mkdir()
        for package in (root / "megatron").iterdir():
            if package.name != "core" and package.is_dir():
                (work / "path" / "megatron" / package.name).symlink_to(package)
        for module in root.glob("*.py"):
            (work / "path" / module.name).symlink_to(module)
    else:
        (work / "path" / "checkout").symlink_to(root)
    text, what = insert_import((root / "pretrain_gpt.py").read_text())
    assert what in ("patched", "already patched")
    (work / "pretrain_gpt.py").write_text(text)
    (work / "runner.py").write_text(RUNNER)
    return work


def _installed_matches(root: pathlib.Path) -> bool:
    """Whether the megatron.core that imports without the checkout is the checkout's release."""

    installed = megatron_version()
    checkout = Version(read_version(root))
    return installed is not None and installed.release[:2] == checkout.release[:2] and \
        pathlib.Path(CHECKOUT).resolve() not in [pathlib.Path(p).resolve() for p in sys.path if p]


def checkout_version() -> tuple[int, int]:
    return Version(read_version(pathlib.Path(CHECKOUT).resolve())).release[:2]


def underlying_losses(log: str) -> dict[int, float]:
    """Per-iteration lm loss. Megatron-LM logs after the first iteration of a run the mean of
    it and the next one (training.py: the accumulator is not reset then); undo that."""
    logged = [(int(m.group(1)), float(m.group(2))) for m in
              re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)", log)]
    return {it: (2 * v - logged[0][1] if i == 1 else v) for i, (it, v) in enumerate(logged)}


def run(workdir, name: str, args: list[str], base: list[str] = TINY) -> dict:
    path = workdir / "path" / "checkout"
    path = path.resolve() if path.exists() else workdir / "path"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", REPORT=str(workdir / f"{name}.json"))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), str(workdir / "runner.py"),
               str(workdir / "pretrain_gpt.py"), *base, *args]
    proc = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    (workdir / f"{name}.log").write_text(log)
    assert proc.returncode == 0, log[-6000:]
    reports = [json.loads((workdir / f"{name}.json.rank{r}").read_text()) for r in range(2)]
    return {"log": log, "losses": underlying_losses(log), "reports": reports}


def features(report: dict) -> dict[str, str]:
    return {f["name"]: f["path"] for f in report["features"] if f["enabled"]}


def test_tp2_sp_loss_falls(workdir):
    result = run(workdir, "tp2sp", TP2_SP)
    losses = result["losses"]
    assert sorted(losses) == list(range(1, 11)) and all(math.isfinite(v) for v in losses.values())
    assert losses[10] < losses[1] - 0.3, losses
    assert sum(losses[i] for i in (8, 9, 10)) < sum(losses[i] for i in (1, 2, 3))
    report = result["reports"][0]
    assert "megatron_lm" in features(report)
    assert any("--transformer-impl local" in n for n in report["notes"]) or "transformer_engine" in sys.modules
    assert "memory (MB) | allocated:" in result["log"]  # Megatron's report, from the accelerator


def test_feature_flags_accepted_applied_and_close(workdir):
    # dropout 0: npuspeed's attention kernels draw dropout from their own (seed, offset) Philox
    # stream, not Megatron's mask (README, fused attention), so only dropout-free runs match
    no_dropout = ["--hidden-dropout", "0", "--attention-dropout", "0"]
    base = run(workdir, "llama", TP2_SP + LLAMA + no_dropout)
    fast = run(workdir, "llama_features", TP2_SP + LLAMA + FEATURES + no_dropout)
    for report in fast["reports"]:
        on = features(report)
        for name in ("fused_attention", "fused_rmsnorm", "fused_swiglu", "fused_rotary_pos_emb",
                     "recompute_activation", "coc_overlap", "megatron_lm"):
            assert name in on, (name, sorted(on))
        calls, probes = report["calls"], report["probes"]
        assert calls.get("rms_norm:cpp", 0) > 0 and calls.get("swiglu:cpp", 0) > 0
        assert calls.get("rotary_pos_emb:cpp", 0) > 0
        assert probes["attention_patched"] == 1 and probes["attention"] > 0
        assert probes["coc_column"] > 0 and probes["coc_row"] > 0
        assert "MLPs selected in this process: 2" in on["recompute_activation"]
    for it, value in base["losses"].items():  # fp32: the fused paths match to rounding
        assert abs(fast["losses"][it] - value) < 1e-4, (it, value, fast["losses"][it])


def test_save_load_round_trip_dp2_distributed_optimizer(workdir):
    args = ["--use-distributed-optimizer"]
    full = run(workdir, "dp2_full", args)
    ckpt = workdir / "ckpt"
    first = run(workdir, "dp2_first", args + ["--save", str(ckpt), "--save-interval", "5",
                                              "--exit-interval", "5"])
    assert sorted(first["losses"]) == [1, 2, 3, 4, 5]
    resumed = run(workdir, "dp2_resumed", args + ["--load", str(ckpt)])
    assert sorted(resumed["losses"]) == [6, 7, 8, 9, 10]
    for it, value in resumed["losses"].items():
        assert abs(value - full["losses"][it]) < 1e-5, (it, value, full["losses"][it])


# -- Megatron's own newer features under npuspeed (CPU, no Transformer Engine) ---------------------
def _at_least(release: tuple[int, int]) -> bool:
    try:
        return checkout_version() >= release
    except Exception:  # no checkout: the module is skipped anyway
        return False


NEWER = pytest.mark.skipif(not _at_least((0, 18)), reason="Megatron-LM core_v0.18+ flags")
MOE = "--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall".split()


def _short(args: list[str], iters: int = 4) -> list[str]:
    return args + ["--train-iters", str(iters)]  # argparse: the last --train-iters wins


def _trains(result: dict, iters: int) -> None:
    losses = result["losses"]
    assert sorted(losses) == list(range(1, iters + 1)) and all(math.isfinite(v) for v in losses.values())
    assert losses[iters] < losses[1], losses


@NEWER
def test_recompute_modules_layernorm(workdir):
    """--recompute-modules layernorm: Megatron's CheckpointWithoutOutput around both norms of every
    layer (without TE it needed the device feature's FP8 fix: megatron_compat.py)."""
    result = run(workdir, "recompute_layernorm", _short(
        ["--recompute-granularity", "selective", "--recompute-modules", "layernorm"]))
    _trains(result, 4)
    for report in result["reports"]:  # DP2: 2 layers x 2 norms x 1 micro-batch x 4 steps, per rank
        assert report["probes"]["checkpoint_without_output"] == 2 * 2 * 1 * 4


@NEWER
@pytest.mark.slow
def test_pipeline_model_parallel_layout(workdir):
    """--pipeline-model-parallel-layout "Et|tttL": 1 layer on the first stage, 3 on the last."""
    result = run(workdir, "pp_layout", _short(["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                               "--pipeline-model-parallel-layout", "Et|tttL"]))
    _trains(result, 4)
    first, last = (r["probes"]["transformer_layer"] for r in result["reports"])
    assert first > 0 and last == 3 * first, (first, last)


@NEWER
@pytest.mark.slow
def test_overlap_moe_expert_parallel_comm(workdir):
    """--overlap-moe-expert-parallel-comm at EP2 (alltoall, bf16): the combined 1F1B schedule runs."""
    result = run(workdir, "ep_overlap", _short(MOE + ["--expert-model-parallel-size", "2", "--bf16", "--swiglu",
                                                      "--disable-bias-linear",
                                                      "--overlap-moe-expert-parallel-comm"]))
    _trains(result, 4)
    assert all(r["probes"]["combined_1f1b"] > 0 for r in result["reports"])


def _indexed_ids(workdir, vocab: int) -> str:
    """A small Megatron indexed dataset (examples/preprocess_data.py, NullTokenizer: each
    document's text is whitespace-separated ids) that both trainers read with the same
    GPTDataset settings, so they see the same first batch."""
    gen = __import__("random").Random(0)
    jsonl = workdir / "ids.jsonl"
    with open(jsonl, "w") as fh:
        for _ in range(40):
            ids = [str(gen.randrange(vocab)) for _ in range(gen.randrange(20, 120))]
            fh.write(json.dumps({"text": " ".join(ids)}) + "\n")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "preprocess_data.py"), "--input", str(jsonl),
                           "--output-prefix", str(workdir / "ids"), "--tokenizer-type", "NullTokenizer",
                           "--vocab-size", str(vocab), "--append-eod", "--workers", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(workdir / "ids_text_document")


def test_resumes_from_a_converted_hugging_face_model(workdir):
    """`npuspeed convert hf-to-megatron` (issue 37): Megatron-LM's own pretrain_gpt.py loads the
    checkpoint at TP2 with the printed flags and --finetune, and its first loss equals the
    example's from the same checkpoint on the same indexed data (NullTokenizer ids, split
    100,0,0, the same seed and sample count: the same GPTDataset order). The Hugging Face
    model's output layer is scaled so that its loss is far above a fresh model's ln(vocabulary):
    the equal first losses are the converted weights', not a fresh initialisation's."""
    import torch

    from hf_tiny import VOCAB, make_hf
    from launch import run_example

    hf_model = make_hf(workdir / "hf_model", "qwen2")  # QKV bias, GQA, untied
    with torch.no_grad():
        hf_model.lm_head.weight.mul_(40.0)
    hf_model.save_pretrained(str(workdir / "hf"))
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "npuspeed.cli", "convert", "hf-to-megatron", "--hf",
                           str(workdir / "hf"), "--save", str(workdir / "converted"), "--tensor-model-parallel-size",
                           "2", "--make-vocab-size-divisible-by", "1", "--fp32"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    flags = (workdir / "converted" / "megatron_args.txt").read_text().split()
    # NullTokenizer: ids 0..N-1 plus its end-of-document id, so N = 257 gives the model's 258
    data = ["--data-path", _indexed_ids(workdir, VOCAB - 1), "--split", "100,0,0", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", str(VOCAB - 1), "--train-iters", "2", "--lr", "1e-4",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234"]
    result = run(workdir, "converted", flags + data + ["--load", str(workdir / "converted"), "--finetune",
                                                       "--data-cache-path", str(workdir / "cache_lm")],
                 base=[a for a in TINY if a != "--mock-data"])
    assert "successfully loaded checkpoint" in result["log"], result["log"][-3000:]
    example = run_example(flags + data + ["--load", str(workdir / "converted"), "--no-load-optim", "--seq-length",
                                          "64", "--micro-batch-size", "2", "--global-batch-size", "4",
                                          "--data-cache-path", str(workdir / "cache_example"),
                                          "--use-cpu-initialization", "--log-interval", "1"],
                          workdir, nproc=2, name="converted_example")
    first = result["losses"][1]
    assert first > 2 * math.log(VOCAB), (first, example["losses"])  # the converted model's, not a fresh one's
    assert abs(first - example["losses"][0]) <= 1e-5, (result["losses"], example["losses"])


def test_dualpipev_trains_and_reports_its_loss(workdir):
    """`--schedules-method dualpipev` under Megatron-LM's pretrain_gpt.py (PP 2, 2 ranks): the loss
    lives on pipeline rank 0 under the V, and Megatron-LM's log line (printed by its "last rank",
    which npuspeed points at the rank holding the loss) shows it every iteration (without that:
    no loss at all in the log), falling. Megatron-LM initialises weights in build order, so the V
    starts from other weights than the interleaved run: the two first losses are only close."""
    args = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage",
            "1", "--untie-embeddings-and-output-weights", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--hidden-dropout", "0", "--attention-dropout", "0"]
    base = run(workdir, "interleaved", args)
    dual = run(workdir, "dualpipev", args + ["--schedules-method", "dualpipev"])
    assert sorted(dual["losses"]) == list(range(1, 11)), dual["log"][-3000:]
    losses = dual["losses"]
    assert losses[10] < losses[1] - 0.3 and abs(losses[1] - base["losses"][1]) < 0.1, (losses, base["losses"])
    assert "dualpipev" in features(dual["reports"][0])
