"""Tokenizers of the example: byte-level (no files needed), null (ids as text), HuggingFace.

Each has what megatron.core's GPTDataset reads from a tokenizer (vocab_size, eod, pad and
unique_identifiers, which goes into the dataset cache hash) plus tokenize/detokenize.
pad == -1 means "no pad id" (Megatron's convention): GPTDataset then masks nothing by id.
"""

import os
from collections import OrderedDict

TOKENIZER_TYPES = ("ByteLevelTokenizer", "HuggingFaceTokenizer", "NullTokenizer")


class ByteLevelTokenizer:
    """UTF-8 bytes 0-255, then eod=256 and pad=257: any text, no tokenizer file to ship."""

    vocab_size = 258
    eod = 256
    pad = 257

    def __init__(self):
        self.unique_identifiers = OrderedDict([("class", type(self).__name__)])

    def tokenize(self, text):
        return list(text.encode("utf-8"))

    def detokenize(self, ids):
        # Special ids have no bytes: drop them rather than fail on a sample with eod inside.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class NullTokenizer:
    """Text is whitespace-separated ids (as Megatron-LM's NullTokenizer): ids 0..N-1, eod=N."""

    pad = -1

    def __init__(self, vocab_size):
        self.eod = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("vocab_size", self.vocab_size)]
        )

    def tokenize(self, text):
        return [int(x) for x in text.split()]

    def detokenize(self, ids):
        return " ".join(str(int(i)) for i in ids)


class HuggingFaceTokenizer:
    """transformers.AutoTokenizer from a local folder; eod is the model's eos token."""

    def __init__(self, model_path):
        try:
            import transformers
        except ImportError as err:
            raise ImportError(
                "--tokenizer-type HuggingFaceTokenizer needs the `transformers` package, which is "
                f"not installed (asked to load --tokenizer-model {model_path}). Fix: "
                "`pip install transformers` (it must not replace torch), or use "
                "--tokenizer-type ByteLevelTokenizer, which needs no files."
            ) from err
        self._tok = transformers.AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        if self._tok.eos_token_id is None:
            raise ValueError(
                f"--tokenizer-model {model_path}: the tokenizer has no eos token to use as eod; "
                "pick a tokenizer with an eos token or use --tokenizer-type ByteLevelTokenizer."
            )
        self.vocab_size = len(self._tok)
        self.eod = int(self._tok.eos_token_id)
        pad = self._tok.pad_token_id
        self.pad = -1 if pad is None else int(pad)
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("path", os.path.abspath(model_path)),
             ("vocab_size", self.vocab_size)]
        )

    def tokenize(self, text):
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def detokenize(self, ids):
        return self._tok.decode([int(i) for i in ids])


def build_tokenizer(tokenizer_type, tokenizer_model=None, vocab_size=None):
    """Build by name; every misuse names the flag to change."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {tokenizer_type}: choose one of {TOKENIZER_TYPES}")
    if vocab_size is not None and tokenizer_type != "NullTokenizer":
        # Refuse rather than ignore: the vocabulary is fixed by the tokenizer itself.
        raise ValueError(
            f"--vocab-size is only used with --tokenizer-type NullTokenizer; {tokenizer_type} "
            "has its own vocabulary. Drop --vocab-size."
        )
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or vocab_size < 1:
            raise ValueError(
                "--tokenizer-type NullTokenizer needs --vocab-size N (ids 0..N-1; eod is N)."
            )
        return NullTokenizer(vocab_size)
    if not tokenizer_model or not os.path.exists(tokenizer_model):
        raise ValueError(
            "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model set to a LOCAL "
            f"tokenizer folder (got {tokenizer_model!r}); this example never downloads. Save one "
            "with tokenizer.save_pretrained(path) on a machine with network access."
        )
    return HuggingFaceTokenizer(tokenizer_model)
