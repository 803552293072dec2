"""JSONL -> Megatron indexed dataset ({prefix}_{key}_document.bin/.idx), as Megatron-LM names it.

    python examples/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type ByteLevelTokenizer --append-eod --workers 2

Then train with --data-path data/corpus_text_document. One document per JSON line; documents
whose text tokenizes to nothing are skipped (counted in the summary).
"""

import argparse
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for gpt_example

from gpt_example.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402

_encoder = None  # per-process state of the pool workers


class Encoder:
    """Tokenizes one JSON line for every --json-keys field (built once per worker process)."""

    def __init__(self, args):
        self.keys = args.json_keys
        self.append_eod = args.append_eod
        self.tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)

    def encode(self, line):
        doc = json.loads(line)
        out = {}
        for key in self.keys:
            if key not in doc:
                raise KeyError(f"--json-keys {key}: a line has no field {key!r}: {line[:80]!r}")
            ids = self.tokenizer.tokenize(doc[key])
            if ids and self.append_eod:
                ids.append(self.tokenizer.eod)
            out[key] = ids
        return out, len(line.encode("utf-8"))


def _init_worker(args):
    global _encoder
    _encoder = Encoder(args)


def _encode(line):
    return _encoder.encode(line)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="JSONL file, one document per line")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--tokenizer-type", default="ByteLevelTokenizer", choices=TOKENIZER_TYPES)
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--append-eod", action="store_true", help="end every document with eod")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    return p.parse_args(argv)


def _lines(path):
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield line


def main(argv=None):
    args = parse_args(argv)
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tqdm import tqdm

    encoder = Encoder(args)  # fails here, before any worker starts, on a bad tokenizer flag
    dtype = DType.optimal_dtype(encoder.tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    builders = {k: IndexedDatasetBuilder(paths[k] + ".bin", dtype=dtype) for k in args.json_keys}

    pool = None
    if args.workers > 1:
        pool = multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=(args,))
        results = pool.imap(_encode, _lines(args.input), chunksize=64)
    else:
        results = map(encoder.encode, _lines(args.input))

    docs = skipped = tokens = nbytes = 0
    start = time.time()
    bar = tqdm(total=os.path.getsize(args.input), unit="B", unit_scale=True, mininterval=0.5,
               desc="tokenizing", dynamic_ncols=True)
    try:
        for out, size in results:
            nbytes += size
            bar.update(size)
            if not any(out.values()):
                skipped += 1
                continue
            docs += 1
            for key, ids in out.items():
                builders[key].add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
                tokens += len(ids)
            if docs % 256 == 0:
                bar.set_postfix(docs_s=f"{docs / max(time.time() - start, 1e-9):.0f}")
    finally:
        bar.set_postfix(docs_s=f"{docs / max(time.time() - start, 1e-9):.0f}")
        bar.close()
        if pool is not None:
            pool.close()
            pool.join()
    for key, builder in builders.items():
        builder.finalize(paths[key] + ".idx")

    elapsed = max(time.time() - start, 1e-9)
    outputs = ", ".join(f"{p}.bin/.idx" for p in paths.values())
    print(f"preprocess_data: {docs} documents ({skipped} empty skipped), {tokens} tokens "
          f"({numpy.dtype(dtype).name}), {nbytes / 1e6:.2f} MB in {elapsed:.2f} s "
          f"({docs / elapsed:.0f} docs/s, {nbytes / 1e6 / elapsed:.2f} MB/s) -> {outputs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
