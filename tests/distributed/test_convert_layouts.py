"""Converted checkpoints at TP2, PP2 and EP2 (issue 37's acceptance), on gloo ranks.

Tiny random models of every converted architecture (tests/hf_tiny.py; Qwen3 with tied
embeddings, so a pipeline's last stage holds the tied output layer), converted once here.

- 2 ranks, one launch (tests/distributed/_convert_layouts_worker.py): each model built at TP2,
  PP2 and, for the MoE ones, EP2, loaded from the converted checkpoint (dist_checkpointing
  reshards it) gives transformers' logits within 1e-5 (fp32) over the whole vocabulary; a
  model whose TP shards are spoilt on purpose (SwiGLU's fc1 split as a plain row block, the
  ranks' query groups swapped) does not, so the comparison catches such a mistake;
- 4 ranks, one launch (slow): loaded at TP2 x PP2 (and the MoE ones at EP2 too), the model
  gives the same logits and is saved from that layout as Megatron-LM saves it; `npuspeed
  convert megatron-to-hf` of that save gives every Hugging Face tensor back bitwise, and
  transformers' logits of the result equal the original model's.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import ranks

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_tiny import VOCAB, hf_tensors, make_hf  # noqa: E402

WORKER = Path(__file__).with_name("_convert_layouts_worker.py")
CASES = {  # name: (architecture, config overrides)
    "llama": ("llama", {}), "mistral": ("mistral", {}), "qwen2": ("qwen2", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}), "mixtral": ("mixtral", {}),
    "qwen2-moe": ("qwen2_moe", {}), "qwen3-moe": ("qwen3_moe", {}),
}
MOE = {"mixtral", "qwen2-moe", "qwen3-moe"}
TWO_RANKS = [dict(name="tp2", tp=2, pp=1, ep=1, etp=None), dict(name="pp2", tp=1, pp=2, ep=1, etp=None),
             dict(name="ep2", tp=1, pp=1, ep=2, etp=1)]
FOUR_RANKS = [dict(name="tp2pp2", tp=2, pp=2, ep=1, etp=None, save=True),
              dict(name="ep2", tp=1, pp=1, ep=2, etp=1, save=True)]
MISTAKES = [dict(case="llama", layout="tp2", mistake="fc1-contiguous"),
            dict(case="llama", layout="tp2", mistake="qkv-rank-order")]
PAIRS = [(c, lay["name"]) for lay in TWO_RANKS for c in CASES if lay["ep"] == 1 or c in MOE]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each case's Hugging Face directory, converted checkpoint and logits on one fixed batch."""
    from npuspeed.convert import hf_to_megatron

    tmp = tmp_path_factory.mktemp("convert_layouts")
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    torch.save(tokens, tmp / "tokens.pt")
    cases = {}
    for name, (arch, overrides) in CASES.items():
        model = make_hf(tmp / name / "hf", arch, **overrides)
        hf_to_megatron.convert(str(tmp / name / "hf"), str(tmp / name / "mg"), tp=2, pp=2,
                               ep=2 if name in MOE else 1)
        with torch.no_grad():
            torch.save(model(tokens).logits, tmp / name / "logits.pt")
        cases[name] = {"hf": str(tmp / name / "hf"), "ckpt": str(tmp / name / "mg" / "iter_0000000"),
                       "logits": str(tmp / name / "logits.pt"), "saves": str(tmp / name / "saved"),
                       "moe": name in MOE}
    return tmp, cases


def _launch(converted, nproc: int, layouts: list[dict], mistakes=()) -> list[dict]:
    tmp, cases = converted
    out = tmp / f"ranks{nproc}"
    out.mkdir()
    plan = {"cases": cases, "layouts": layouts, "mistakes": list(mistakes), "tokens": str(tmp / "tokens.pt"),
            "out": str(out)}
    (out / "plan.json").write_text(json.dumps(plan))
    done = ranks.wait(ranks.start(WORKER, [str(out / "plan.json")], nproc), timeout=900)
    for rank in done:
        assert rank.rc == 0, rank.err[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def two_ranks(converted):
    return _launch(converted, 2, TWO_RANKS, MISTAKES)


@pytest.mark.parametrize("case,layout", PAIRS, ids=[f"{c}-{lay}" for c, lay in PAIRS])
def test_logits_at_two_rank_layouts(two_ranks, case, layout):
    key = f"{case}/{layout}"
    found = [r[key] for r in two_ranks if key in r]
    # TP2 and EP2: both ranks hold the logits; PP2: the last stage
    assert len(found) == (1 if layout == "pp2" else 2), two_ranks
    assert max(found) <= 1e-5, found


@pytest.mark.parametrize("mistake", [m["mistake"] for m in MISTAKES])
def test_spoilt_tp_shards_are_caught(two_ranks, mistake):
    found = [r[f"llama/tp2/{mistake}"] for r in two_ranks]
    assert min(found) > 1e-3, found


WRITTEN_BY = {"tp2pp2": "decoder.layers.self_attention.linear_qkv.weight",  # a TP x PP split tensor
              "ep2": "decoder.layers.mlp.experts.experts.linear_fc1.weight"}  # experts 0-1 and 2-3


def _writers(path: Path, key: str) -> set[int]:
    """The ranks whose files (`__<rank>_<n>.distcp`) hold a part of stored tensor `key`."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(path)).read_metadata().storage_data
    return {int(info.relative_path.split("_")[2]) for index, info in storage.items() if index.fqn == key}


@pytest.mark.slow  # 4 oversubscribed ranks on 2 cores: `make bench` runs it
def test_round_trip_through_a_megatron_save(converted):
    from npuspeed.convert import megatron_to_hf

    tmp, cases = converted
    diffs = _launch(converted, 4, FOUR_RANKS)
    tokens = torch.load(tmp / "tokens.pt")
    for name, case in cases.items():
        for lay in FOUR_RANKS:
            if lay["ep"] > 1 and not case["moe"]:
                continue
            key = f"{name}/{lay['name']}"
            found = [r[key] for r in diffs if key in r]
            assert found and max(found) <= 1e-5, (key, found)
            saved = Path(case["saves"]) / lay["name"]
            assert _writers(saved / "iter_0000001", WRITTEN_BY[lay["name"]]) == set(
                range(4 if lay["pp"] > 1 else 2)), key  # saved from that layout, by every rank holding a part
            back = tmp / name / f"back_{lay['name']}"
            megatron_to_hf.convert(str(saved), str(back), hf_config=case["hf"], max_shard_bytes=40_000)
            before, after = hf_tensors(case["hf"]), hf_tensors(back)
            assert sorted(before) == sorted(after), key
            unequal = [k for k in before if not torch.equal(before[k], after[k])]
            assert not unequal, (key, unequal)
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(back)).float().eval()
            with torch.no_grad():
                assert torch.equal(reloaded(tokens).logits, torch.load(case["logits"])), key
