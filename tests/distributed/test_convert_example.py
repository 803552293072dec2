"""A Hugging Face model converted by `npuspeed convert` trains in the example, at TP1, TP2 and
PP2 with two virtual stages from the same TP1-written checkpoint (dist_checkpointing reshards
it on load), and goes back to a Hugging Face directory that transformers loads with the
Megatron model's logits.

- the flags the converter printed are all the example needs to describe the model;
- a converted Mixtral starts at EP2 from the same loss as at EP1, and so do EP2 reading the
  Hugging Face directory itself and GroupedMLP (--moe-grouped-gemm), whose save converts back;
- TP2's and PP2 x VPP2's first losses equal TP1's within 1e-5 (fp32): the checkpoint loads at any
  layout; 10 iterations at TP1 lower the loss; so does TP2 reading the Hugging Face directory
  itself (--hf-checkpoint, no checkpoint written);
- TP2's saved checkpoint converts back (with --hf-config: the example's own checkpoints do not
  hold the Hugging Face config) and transformers' logits equal the Megatron model's within 1e-5.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from launch import ROOT, run_example

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

TRAIN = ["--use-cpu-initialization", "--seq-length", "32", "--global-batch-size", "4", "--micro-batch-size", "2",
         "--log-interval", "1", "--lr", "3e-3"]


def _cli(*argv) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "npuspeed.cli", "convert", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _convert(tmp, arch: str, **overrides):
    from hf_tiny import make_hf

    make_hf(tmp / "hf", arch, **overrides)
    out = _cli("hf-to-megatron", "--hf", str(tmp / "hf"), "--save", str(tmp / "mg"),
               "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "1", "--fp32")
    flags = (tmp / "mg" / "megatron_args.txt").read_text().split()
    assert " ".join(flags) in out  # printed, and saved beside the checkpoint
    model_flags = flags[:flags.index("--tensor-model-parallel-size")]
    return tmp, model_flags


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    # QKV bias, GQA, untied output; 4 layers for PP2 with 2 virtual stages
    return _convert(tmp_path_factory.mktemp("convert_example"), "qwen2", num_hidden_layers=4)


@pytest.mark.slow  # CI time (about 2 min on 2 cores): `make bench` runs it
def test_mixtral_at_ep2(tmp_path, megatron_mp):
    """A converted Mixtral (4 experts, top-2) starts at EP2, and with --moe-grouped-gemm, from the
    same loss as at EP1; GroupedMLP's save converts back to logits transformers reproduces."""
    converted = _convert(tmp_path, "mixtral")
    ep1 = _run(converted, "ep1", 1, [], 1)
    ep2 = _run(converted, "ep2", 2, ["--expert-model-parallel-size", "2"], 1)
    direct = run_example(TRAIN + converted[1] + ["--expert-model-parallel-size", "2", "--train-iters", "1",
                                                 "--hf-checkpoint", str(tmp_path / "hf")], tmp_path, nproc=2,
                         name="ep2_direct")
    grouped = _run(converted, "grouped", 1, ["--moe-grouped-gemm"], 1, ["--save", str(tmp_path / "grouped_saved")])
    for other in (ep2, direct, grouped):
        assert abs(other["losses"][0] - ep1["losses"][0]) <= 1e-5, (ep1["losses"], other["losses"])
    # GroupedMLP's checkpoint holds the experts as SequentialMLP does: it converts back too
    gap, _ = back_to_hf(tmp_path, "grouped_saved", 1)
    assert gap <= 1e-5, gap


def back_to_hf(tmp, saved: str, iteration: int):
    """`megatron-to-hf` of the example's save `tmp/saved` (the original config from `tmp/hf`) into
    `tmp/back`: (the largest gap between transformers' logits of it and the Megatron model's, the
    logits of tokens that transformers gives from it)."""
    out = _cli("megatron-to-hf", "--load", str(tmp / saved), "--save", str(tmp / "back"), "--hf-config", str(tmp / "hf"))
    assert "-> " in out  # what went where, printed
    from hf_tiny import VOCAB, megatron_logits_at

    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    logits = megatron_logits_at(str(tmp / saved / f"iter_{iteration:07d}"), str(tmp / "hf" / "config.json"), tokens)
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(str(tmp / "back")).float().eval()(tokens).logits
    return (logits[..., :VOCAB] - want).abs().max().item(), (tokens, want)


def _run(converted, name, nproc, layout, iters, extra=()):
    tmp, model_flags = converted
    args = TRAIN + model_flags + layout + ["--train-iters", str(iters), "--load", str(tmp / "mg"),
                                           "--no-load-optim", *extra]
    return run_example(args, tmp, nproc=nproc, name=name)


@pytest.mark.slow  # CI time (2-4 min on 2 cores): `make bench` runs it; CI keeps tests/unit/test_convert.py
def test_trains_at_any_layout_and_converts_back(converted, megatron_mp):
    tmp, _ = converted
    tp1 = _run(converted, "tp1", 1, [], 10)
    assert "was converted from Qwen2ForCausalLM" in tp1["log"]
    assert tp1["first_iteration"] == 1 and len(tp1["losses"]) == 10
    assert tp1["losses"][-1] < tp1["losses"][0] - 0.05, tp1["losses"]
    tp2 = _run(converted, "tp2", 2, ["--tensor-model-parallel-size", "2"], 2, ["--save", str(tmp / "tp2_saved")])
    pp2 = _run(converted, "pp2_vpp2", 2, ["--pipeline-model-parallel-size", "2",
                                          "--num-layers-per-virtual-pipeline-stage", "1"], 1)
    # --hf-checkpoint: each rank reads its own shards of the Hugging Face weights, no checkpoint
    model_flags = converted[1]
    direct = run_example(TRAIN + model_flags + ["--tensor-model-parallel-size", "2", "--train-iters", "1",
                                                "--hf-checkpoint", str(tmp / "hf")], tmp, nproc=2, name="direct")
    for other in (tp2, pp2, direct):
        assert abs(other["losses"][0] - tp1["losses"][0]) <= 1e-5, (other["losses"], tp1["losses"])

    diff, (tokens, want) = back_to_hf(tmp, "tp2_saved", 2)
    assert diff <= 1e-5, diff
    before = transformers.AutoModelForCausalLM.from_pretrained(str(tmp / "hf")).float().eval()
    with torch.no_grad():
        assert (before(tokens).logits - want).abs().max().item() > 1e-3  # trained: not the same weights
