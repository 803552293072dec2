"""Data side of examples/pretrain_gpt.py: tokenizers, sample order across DP/resume, indexed data."""

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

from gpt_example import data, tokenizer  # noqa: E402

KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def make_args(*argv, seq=16, mbs=2, gbs=8, seed=1234, iters=10):
    """The lead's parser owns these flags; mirror them here."""
    p = argparse.ArgumentParser()
    data.add_data_args(p)
    p.add_argument("--seq-length", type=int, default=seq)
    p.add_argument("--micro-batch-size", type=int, default=mbs)
    p.add_argument("--global-batch-size", type=int, default=gbs)
    p.add_argument("--seed", type=int, default=seed)
    p.add_argument("--train-iters", type=int, default=iters)
    return p.parse_args(list(argv))


def take(args, n, consumed=0, dp_rank=0, dp_size=1):
    it = data.build_train_iterator(args, data.build_tokenizer(args), consumed, dp_rank, dp_size)
    return [next(it) for _ in range(n)]


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in KEYS)


def test_byte_tokenizer_round_trip():
    tok = tokenizer.build_tokenizer("ByteLevelTokenizer")
    text = "Grüße, 世界! tab\tnewline\n"
    ids = tok.tokenize(text)
    assert len(ids) == len(text.encode("utf-8")) and max(ids) < 256
    assert tok.detokenize(ids) == text
    assert tok.detokenize(ids + [tok.eod, tok.pad]) == text  # specials carry no bytes
    assert (tok.vocab_size, tok.eod, tok.pad) == (258, 256, 257)


def test_null_tokenizer_and_flag_errors():
    tok = tokenizer.build_tokenizer("NullTokenizer", vocab_size=100)
    assert (tok.vocab_size, tok.eod) == (101, 100)
    assert tok.tokenize("3 1 4") == [3, 1, 4] and tok.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(ValueError, match="--vocab-size"):
        tokenizer.build_tokenizer("NullTokenizer")
    with pytest.raises(ValueError, match="--vocab-size"):
        tokenizer.build_tokenizer("ByteLevelTokenizer", vocab_size=300)


def test_hf_tokenizer_errors_name_the_flag(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="--tokenizer-model"):
        tokenizer.build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "absent"))
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if not installed
    with pytest.raises(ImportError, match="--tokenizer-model") as err:
        tokenizer.build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    assert "pip install transformers" in str(err.value)


def test_mock_batch_shapes_and_rule():
    args = make_args(seq=16, mbs=3, gbs=6)
    tok = data.build_tokenizer(args)
    b = take(args, 1)[0]
    for k in KEYS:
        assert b[k].shape == (3, 16)
    assert b["tokens"].dtype == b["labels"].dtype == b["position_ids"].dtype == torch.int64
    assert b["loss_mask"].dtype == torch.float32 and bool((b["loss_mask"] == 1).all())
    assert torch.equal(b["labels"][:, :-1], b["tokens"][:, 1:])
    assert torch.equal(b["position_ids"], torch.arange(16).expand(3, 16))
    assert int(b["tokens"].max()) < min(tok.eod, tok.pad)
    # Every sample follows one of the affine rules: the data is learnable.
    for row_t, row_l in zip(b["tokens"], b["labels"]):
        n = data.MOCK_IDS
        assert any(torch.equal((a * row_t + c) % n, row_l) for a, c in data.MOCK_RULES)


def test_mock_depends_on_seed_only():
    a, b = take(make_args(seed=1), 2), take(make_args(seed=1), 2)
    c = take(make_args(seed=2), 2)
    assert all(same(x, y) for x, y in zip(a, b))
    assert not same(a[0], c[0])


def test_mock_dp2_shards_interleave_to_dp1_stream():
    args = make_args(mbs=2, gbs=8)
    single = take(args, 8)  # 2 global batches, 4 micro-batches each
    r0, r1 = take(args, 4, dp_rank=0, dp_size=2), take(args, 4, dp_rank=1, dp_size=2)
    interleaved = [mb for pair in zip(r0, r1) for mb in pair]
    assert all(same(x, y) for x, y in zip(single, interleaved))
    assert not same(r0[0], r1[0])


def test_mock_resume_and_workers_match_uninterrupted_run():
    args = make_args(mbs=2, gbs=8)
    for dp_rank in (0, 1):
        full = take(args, 6, dp_rank=dp_rank, dp_size=2)  # 3 global batches of 2 micro-batches
        resumed = take(args, 2, consumed=2 * 8, dp_rank=dp_rank, dp_size=2)
        assert all(same(x, y) for x, y in zip(full[4:], resumed))
    workers = take(make_args("--num-workers", "2", mbs=2, gbs=8), 4)
    assert all(same(x, y) for x, y in zip(take(args, 4), workers))


def test_sampler_order_and_drop_last():
    s = data.MegatronOrderBatchSampler(21, 4, micro_batch_size=2, dp_rank=1, dp_size=3)
    assert list(s) == [[6, 7], [12, 13]] and len(s) == 2  # 22..27 would pass the end: dropped


def test_flag_conflicts():
    with pytest.raises(ValueError, match="--global-batch-size"):
        take(make_args(mbs=2, gbs=6), 1, dp_size=2)
    with pytest.raises(ValueError, match="--mock-data"):
        take(make_args("--mock-data", "--data-path", "x"), 1)


def _preprocess(tmp_path, docs):
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    out = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "preprocess_data.py"), "--input", str(src),
         "--output-prefix", str(tmp_path / "out" / "corpus"), "--append-eod", "--workers", "2"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, str(tmp_path / "out" / "corpus_text_document")


def test_preprocess_then_indexed_iterator_decodes_to_input(tmp_path):
    docs = [f"doc {i} ü" + " w" * (i % 4) for i in range(30)]
    docs.insert(7, "")  # tokenizes to nothing: skipped, not an empty document
    stdout, prefix = _preprocess(tmp_path, docs)
    assert "30 documents (1 empty skipped)" in stdout and "docs/s" in stdout

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tok = tokenizer.ByteLevelTokenizer()
    ds = IndexedDataset(prefix)
    texts = [d for d in docs if d]
    assert len(ds) == 30
    assert [tok.detokenize(ds[i].tolist()) for i in range(30)] == texts
    assert all(int(ds[i][-1]) == tok.eod for i in range(30))

    args = make_args("--data-path", prefix, "--data-cache-path", str(tmp_path / "cache"),
                     seq=32, mbs=2, gbs=4, iters=10)
    batches = take(args, 10)
    encoded = [d.encode("utf-8") for d in texts]
    pieces = 0
    for b in batches:
        assert b["tokens"].shape == (2, 32) and b["loss_mask"].dtype == torch.float32
        assert torch.equal(b["labels"][:, :-1], b["tokens"][:, 1:])
        assert torch.equal(b["position_ids"], torch.arange(32).expand(2, 32))
        for row in torch.cat([b["tokens"], b["labels"][:, -1:]], dim=1).tolist():
            # A sample is a window over whole documents joined by eod (compare bytes: a window
            # may cut a multi-byte character).
            parts = bytes(t if t != tok.eod else 0 for t in row).split(b"\0")
            if len(parts) == 1:
                assert any(parts[0] in d for d in encoded)
                continue
            assert any(d.endswith(parts[0]) for d in encoded)
            assert any(d.startswith(parts[-1]) for d in encoded)
            for middle in parts[1:-1]:
                assert middle in encoded
                pieces += 1
    assert pieces > 0  # some whole documents were checked exactly

    resumed = take(args, 4, consumed=3 * 4, dp_rank=1, dp_size=2)
    full = take(args, 8, dp_rank=1, dp_size=2)
    assert all(same(x, y) for x, y in zip(full[3:7], resumed))

    two = make_args("--data-path", prefix, prefix, "--data-cache-path", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="torch.distributed"):
        take(two, 1)


def test_document_mask_is_megatron_ltor_mask_built_where_tokens_are():
    """The vectorized mask (no host loops, so it is built on the accelerator) equals the
    per-EoD construction of Megatron-LM's get_ltor_masks_and_position_ids."""
    from gpt_example import documents

    eod = 9
    tokens = torch.tensor([[1, 2, eod, 3, 4, 5, eod, 6], [eod, 1, 2, 3, eod, eod, 4, 5]])
    b, s = tokens.shape
    ref = torch.ones(s, s, dtype=torch.bool).triu_(1).expand(b, 1, s, s).clone()
    for row in range(b):
        for i in (tokens[row] == eod).nonzero().flatten().tolist():
            ref[row, 0, i + 1:, : i + 1] = True
    mask = documents.document_mask(tokens, eod)
    assert mask.shape == (b, 1, s, s) and mask.dtype == torch.bool
    assert torch.equal(mask, ref)
    assert documents.document_mask(tokens.to("meta"), eod).device.type == "meta"  # made beside the tokens
