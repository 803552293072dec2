"""Converted checkpoints at TP2, PP2 and EP2 (issue 37's acceptance), on gloo ranks.

Tiny random models of every converted architecture (tests/hf_tiny.py; Qwen3 with tied
embeddings, so a pipeline's last stage holds the tied output layer), converted once here.

One launch of 4 gloo ranks (tests/distributed/_convert_layouts_worker.py; starting the
processes is most of the cost, so every layout runs in it, the smaller ones data-parallel):
- each model built at TP2, PP2, TP2 x PP2 and, for the MoE ones, EP2, loaded from the converted
  checkpoint (dist_checkpointing reshards it) gives transformers' logits within 1e-5 (fp32) over
  the whole vocabulary; a model whose TP shards are spoilt on purpose (SwiGLU's fc1 split as a
  plain row block, the ranks' query groups swapped) does not: the comparison catches such a mistake;
- saved from TP2 x PP2 (and EP2 for the MoE ones) as Megatron-LM saves it, every rank writing
  its part, `npuspeed convert megatron-to-hf` of that save gives every Hugging Face tensor back
  bitwise, and transformers' logits of the result equal the original model's.
"""
from __future__ import annotations

import json
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
    # MLA; V3: sigmoid routing with its bias, 2 groups; V2: softmax, group-limited (2 layers: one dense)
    "deepseek-v3": ("deepseek_v3", {}), "deepseek-v2": ("deepseek_v2", {}),
}
MOE = {"mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v3", "deepseek-v2"}
WORLD = 4
LAYOUTS = [dict(name="tp2", tp=2, pp=1, ep=1, etp=None), dict(name="pp2", tp=1, pp=2, ep=1, etp=None),
           dict(name="tp2pp2", tp=2, pp=2, ep=1, etp=None, save=True),
           dict(name="ep2", tp=1, pp=1, ep=2, etp=1, save=True)]
MISTAKES = [dict(case="llama", layout="tp2", mistake="fc1-contiguous"),
            dict(case="llama", layout="tp2", mistake="qkv-rank-order")]
PAIRS = [(c, lay["name"]) for lay in LAYOUTS for c in CASES if lay["ep"] == 1 or c in MOE]
SAVED = [(c, lay) for c, lay in PAIRS if lay in {x["name"] for x in LAYOUTS if x.get("save")}]
HOLDERS = {"tp2": 4, "pp2": 2, "tp2pp2": 2, "ep2": 4}  # ranks with the logits: the last stage, 2 or 1 data-parallel
WRITTEN_BY = {"tp2pp2": ("decoder.layers.self_attention.linear_qkv.weight", {0, 1, 2, 3}),  # split TP x PP
              "ep2": ("decoder.layers.mlp.experts.experts.linear_fc1.weight", {0, 1})}  # experts 0-1 and 2-3
#: DeepSeek's layers differ (a dense first layer), so Megatron stores each layer under its own key:
#: the first stage's TP ranks write layer 0's query projection
WRITTEN_BY_MLA = {"tp2pp2": ("decoder.layers.0.self_attention.linear_q_up_proj.weight", {0, 1}),
                  "ep2": ("decoder.layers.1.mlp.experts.experts.linear_fc1.weight", {0, 1})}


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


@pytest.fixture(scope="module")
def launched(converted) -> list[dict]:
    """Every rank's {"<case>/<layout>[/<mistake>]": max |logits - transformers'|}."""
    tmp, cases = converted
    out = tmp / "ranks"
    out.mkdir()
    plan = {"cases": cases, "layouts": LAYOUTS, "mistakes": MISTAKES, "tokens": str(tmp / "tokens.pt"),
            "out": str(out)}
    (out / "plan.json").write_text(json.dumps(plan))
    done = ranks.wait(ranks.start(WORKER, [str(out / "plan.json")], WORLD), timeout=900)
    for rank in done:
        assert rank.rc == 0, rank.err[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("case,layout", PAIRS, ids=[f"{c}-{lay}" for c, lay in PAIRS])
def test_logits_at_each_layout(launched, case, layout):
    key = f"{case}/{layout}"
    found = [r[key] for r in launched if key in r]
    assert len(found) == HOLDERS[layout], launched
    assert max(found) <= 1e-5, found


@pytest.mark.parametrize("mistake", [m["mistake"] for m in MISTAKES])
def test_spoilt_tp_shards_are_caught(launched, mistake):
    found = [r[f"llama/tp2/{mistake}"] for r in launched]
    assert min(found) > 1e-3, found


def _writers(path: Path, key: str) -> set[int]:
    """The ranks whose files (`__<rank>_<n>.distcp`) hold a part of stored tensor `key`."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(path)).read_metadata().storage_data
    return {int(info.relative_path.split("_")[2]) for index, info in storage.items() if index.fqn == key}


@pytest.mark.parametrize("case,layout", SAVED, ids=[f"{c}-{lay}" for c, lay in SAVED])
def test_round_trip_through_a_megatron_save(converted, launched, case, layout):
    from npuspeed.convert import megatron_to_hf

    tmp, cases = converted
    saved = Path(cases[case]["saves"]) / layout
    # saved from that layout: every rank that holds a part of the tensor wrote it
    key, writers = (WRITTEN_BY_MLA if case.startswith("deepseek") else WRITTEN_BY)[layout]
    assert _writers(saved / "iter_0000001", key) == writers
    back = tmp / case / f"back_{layout}"
    megatron_to_hf.convert(str(saved), str(back), hf_config=cases[case]["hf"], max_shard_bytes=40_000)
    before, after = hf_tensors(cases[case]["hf"]), hf_tensors(back)
    assert sorted(before) == sorted(after)
    unequal = [k for k in before if not torch.equal(before[k], after[k])]
    assert not unequal, unequal
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(back)).float().eval()
    with torch.no_grad():
        assert torch.equal(reloaded(torch.load(tmp / "tokens.pt")).logits, torch.load(cases[case]["logits"]))
