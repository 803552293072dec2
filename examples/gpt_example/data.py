"""Training data of the example: learnable synthetic data, or Megatron indexed data (.bin/.idx).

Both are map-style datasets indexed by a global sample number, read in the order of Megatron-LM's
MegatronPretrainingSampler. So the batches depend only on (seed, consumed_samples, DP layout):
a resumed run sees exactly the samples the uninterrupted run would have seen, and TP/PP peers
(same dp_rank) get identical batches without any broadcast.
"""

import getpass
import os
import tempfile

import numpy as np
import torch

from gpt_example import documents
from gpt_example.tokenizer import TOKENIZER_TYPES, build_tokenizer as _build_tokenizer

# (a, c) of the rule token[t+1] = (a * token[t] + c) mod n. Few rules, all with odd a (a
# permutation when n is a power of two), over at most MOCK_IDS ids: a 2-layer hidden-64 model's
# loss falls from ln(258) = 5.6 to about 4.4 in 20 steps at lr 1e-3 (bytes, 8 samples of 64).
MOCK_RULES = ((1, 1), (3, 7), (5, 3), (1, 11))
MOCK_IDS = 64


def add_data_args(parser):
    """Data flags, named as in Megatron-LM so its command lines carry over."""
    group = parser.add_argument_group("data")
    group.add_argument("--data-path", nargs="*", default=None,
                       help="Indexed dataset prefix(es) (prefix.bin/.idx), or weight prefix pairs "
                            "'0.3 a 0.7 b'. Without it, synthetic data is used.")
    group.add_argument("--mock-data", action="store_true",
                       help="Use synthetic learnable data (the default when --data-path is absent).")
    group.add_argument("--split", default="969,30,1",
                       help="train,valid,test weights of the documents; only train is read.")
    group.add_argument("--tokenizer-type", default="ByteLevelTokenizer", choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", default=None,
                       help="Local HuggingFace tokenizer folder (HuggingFaceTokenizer only).")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="NullTokenizer only: ids 0..N-1, eod = N.")
    group.add_argument("--data-cache-path", default=None,
                       help="Where GPTDataset index caches go (default: a per-user temp folder).")
    group.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes.")
    group.add_argument("--mock-document-length", type=int, default=None,
                       help="Synthetic data packs documents of about this many tokens, each ended by EoD "
                            "(default: one document per sample, no EoD).")
    group.add_argument("--reset-attention-mask", action="store_true",
                       help="Attention stays inside each EoD-delimited document (with --use-flash-attn: "
                            "document boundaries, no S x S mask).")
    group.add_argument("--reset-position-ids", action="store_true",
                       help="Position ids restart after every EoD.")
    group.add_argument("--eod-mask-loss", action="store_true", help="No loss on EoD tokens.")
    return parser


def build_tokenizer(args):
    return _build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)


def num_plain_ids(tokenizer):
    """Ids below the first special id: synthetic tokens never collide with eod/pad."""
    specials = [i for i in (tokenizer.eod, tokenizer.pad) if 0 <= i < tokenizer.vocab_size]
    return min(specials + [tokenizer.vocab_size])


class MockGPTDataset(torch.utils.data.Dataset):
    """Sample i follows one affine rule mod n; its rule and start token depend on (seed, i) only.

    A fresh generator per sample (not a shared stream) is what makes data independent of the
    parallel layout, of DataLoader workers and of where a run was resumed.
    """

    def __init__(self, seed, seq_length, n, document_length=None, eod=None, reset_position_ids=False,
                 eod_mask_loss=False):
        if n < 2:
            raise ValueError(f"synthetic data needs a vocabulary of at least 2 ids, got {n}")
        self.seed, self.seq_length, self.n = int(seed), int(seq_length), int(n)
        self.document_length, self.eod = document_length, eod
        self.reset_position_ids, self.eod_mask_loss = reset_position_ids, eod_mask_loss

    def __len__(self):
        return 2**62  # effectively endless; the sampler decides where to stop

    def __getitem__(self, idx):
        rng = np.random.default_rng([self.seed, int(idx)])
        if self.document_length:
            text = torch.from_numpy(documents.mock_documents(rng, self.seq_length + 1, self.document_length,
                                                             self.n, self.eod, MOCK_RULES))
            return documents_sample(text, self.eod, self.reset_position_ids, self.eod_mask_loss)
        a, c = MOCK_RULES[int(rng.integers(len(MOCK_RULES)))]
        text = np.empty(self.seq_length + 1, dtype=np.int64)
        text[0] = rng.integers(self.n)
        for t in range(self.seq_length):
            text[t + 1] = (a * text[t] + c) % self.n
        text = torch.from_numpy(text)
        return {
            "tokens": text[:-1].clone(),
            "labels": text[1:].clone(),
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length, dtype=torch.int64),
        }


def documents_sample(text: torch.Tensor, eod: int, reset_position_ids: bool, eod_mask_loss: bool) -> dict:
    """A packed sample from seq + 1 tokens (as GPTDataset makes it)."""
    tokens = text[:-1].clone()
    loss_mask = torch.ones(tokens.shape[0], dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    positions = (documents.reset_positions(tokens[None], eod)[0] if reset_position_ids
                 else torch.arange(tokens.shape[0], dtype=torch.int64))
    return {"tokens": tokens, "labels": text[1:].clone(), "loss_mask": loss_mask, "position_ids": positions}


class MegatronOrderBatchSampler:
    """Micro-batches of sample indices in MegatronPretrainingSampler's order (own code).

    From consumed_samples on, each run of micro_batch_size * dp_size consecutive indices is one
    micro-batch step across all DP ranks; rank r takes the r-th slice of micro_batch_size.
    An incomplete last step is dropped.
    """

    def __init__(self, total_samples, consumed_samples, micro_batch_size, dp_rank, dp_size):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside 0..{dp_size - 1}")
        if total_samples is not None and consumed_samples >= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} >= dataset size {total_samples}")
        self.total = total_samples
        self.consumed = consumed_samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self):
        step = self.mbs * self.dp_size
        start = self.consumed
        while self.total is None or start + step <= self.total:
            first = start + self.dp_rank * self.mbs
            yield list(range(first, first + self.mbs))
            start += step

    def __len__(self):
        if self.total is None:
            raise TypeError("endless sampler has no length")
        return (self.total - self.consumed) // (self.mbs * self.dp_size)


def _default_cache_path():
    # Deterministic, so that every rank of a job finds the indices rank 0 wrote.
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry (some containers)
        user = "anon"
    return os.path.join(tempfile.gettempdir(), f"npuspeed-gpt-data-cache-{user}")


def build_indexed_dataset(args, tokenizer, num_samples):
    """Train split of --data-path through megatron.core's BlendedMegatronDatasetBuilder.

    With torch.distributed initialised, every rank must call this (the builder builds on rank 0,
    barriers on the default group, then the other ranks load rank 0's cache).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    prefixes, weights = get_blend_from_list(args.data_path)
    prefixes = [p[:-4] if p.endswith((".bin", ".idx")) else p for p in prefixes]
    if len(prefixes) == 1:
        weights = None  # a weight on one prefix would route it through BlendedDataset for nothing
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise FileNotFoundError(
                    f"--data-path {prefix}: {prefix + ext} not found. Make it with "
                    "examples/preprocess_data.py: --output-prefix P writes "
                    "P_text_document.bin/.idx, so pass --data-path P_text_document."
                )
    if len(prefixes) > 1 and not torch.distributed.is_initialized():
        # megatron-core 0.16.1 BlendedDataset calls torch.distributed.get_rank() on a cache miss.
        raise RuntimeError(
            "--data-path with several prefixes (a blend) needs torch.distributed initialised "
            "(megatron-core's BlendedDataset asks for the rank); run under torchrun or give one "
            "prefix."
        )
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=(prefixes, weights),
        split=args.split,
        path_to_cache=args.data_cache_path or _default_cache_path(),
        tokenizer=tokenizer,
        reset_position_ids=bool(getattr(args, "reset_position_ids", False)),
        reset_attention_mask=bool(getattr(args, "reset_attention_mask", False)),  # boundaries from EoD
        eod_mask_loss=bool(getattr(args, "eod_mask_loss", False)),
        create_attention_mask=False,
    )
    # Only train is read: leave valid/test unbuilt (a split with no documents would otherwise
    # make GPTDataset look for tokens forever).
    config.split_matrix = [config.split_matrix[0], None, None]
    if config.split_matrix[0] is None or config.split_matrix[0][0] == config.split_matrix[0][1]:
        raise ValueError(f"--split {args.split} leaves no documents for training")
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [num_samples, 0, 0], lambda: True, config
    ).build()
    return train


def build_train_iterator(args, tokenizer, consumed_samples, dp_rank, dp_size):
    """Endless (synthetic) or run-long (indexed) iterator of this DP rank's micro-batches.

    Each item: tokens/labels/position_ids [mbs, seq] int64 and loss_mask [mbs, seq] float32.
    Indexed data is built with train_iters * global_batch_size samples (more epochs if needed).
    """
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    if gbs % (mbs * dp_size):
        raise ValueError(
            f"--global-batch-size {gbs} must be a multiple of --micro-batch-size {mbs} times the "
            f"data-parallel size {dp_size}"
        )
    if args.data_path and args.mock_data:
        raise ValueError("--mock-data and --data-path exclude each other; drop one")
    if args.data_path:
        train_iters = getattr(args, "train_iters", None)
        num_samples = None if train_iters is None else train_iters * gbs
        dataset = build_indexed_dataset(args, tokenizer, num_samples)
        total = len(dataset)
    else:
        n = min(num_plain_ids(tokenizer), MOCK_IDS)
        dataset = MockGPTDataset(args.seed, args.seq_length, n, args.mock_document_length, tokenizer.eod,
                                 args.reset_position_ids, args.eod_mask_loss)
        total = None
    sampler = MegatronOrderBatchSampler(total, consumed_samples, mbs, dp_rank, dp_size)
    # On an accelerator the batches come in pinned host memory, so the training step's
    # non_blocking copies overlap (the CPU backend has nothing to copy).
    from npuspeed import get_accelerator

    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0, pin_memory=get_accelerator().name != "cpu",
    )
    return iter(loader)
