"""--npuspeed-dump's cost: one training step of a 4-layer GPT (Megatron-Core local spec) through a
schedule-shaped function, without the dump and with it (every module, every step), in one process.

    python benchmarks/bench_dump.py [--hidden 256] [--seq 256] [--levels stats tensors]

Time: the harness's interleaved medians (baseline = the same step unwrapped). Memory: the step's
peak above what was live before it, against the largest single tensor the dump writes (the
--dump-level tensors bound: the dump holds one tensor at a time beyond the run's own). The dump
writes into a temporary folder, removed at the end; its disk time is part of the step.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile

import torch

from harness import Bench, init_single_rank_megatron


def _gpt(args):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.vocab, max_sequence_length=args.seq)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--levels", nargs="+", default=["stats", "tensors"])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    init_single_rank_megatron([])
    from npuspeed.features.dump import hooks

    bench = Bench("dump", warmup=1, repeat=args.repeat)
    model = _gpt(args)
    tokens = torch.randint(0, args.vocab, (args.micro, 2, args.seq))
    position_ids = torch.arange(args.seq).unsqueeze(0).expand(2, args.seq)

    def schedule(*, model, num_microbatches, forward_only=False, **_):
        out = []
        for k in range(num_microbatches):
            loss = model(tokens[k], position_ids, None, labels=torch.roll(tokens[k], -1, 1)).float().mean()
            (loss / num_microbatches).backward()
            out.append({"lm loss": loss.detach()})
        model.zero_grad(set_to_none=True)
        return out

    def baseline():
        return schedule(model=model, num_microbatches=args.micro)

    for level in args.levels:
        folder = tempfile.mkdtemp(prefix="bench_dump_")
        dumper = hooks.Dumper(folder, None, ("*",), level, print)
        wrapped = dumper.wrap_schedule(schedule)
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        largest = max(largest, args.seq * 2 * args.vocab * 4)  # the logits
        bench.compare(f"gpt L{args.layers} h{args.hidden} s{args.seq} x{args.micro} mb, dump {level}", "fp32",
                      baseline=baseline, feature=lambda: wrapped(model=model, num_microbatches=args.micro),
                      extra={"largest_tensor_bytes": largest})
        dumper._detach()
        shutil.rmtree(folder, ignore_errors=True)
    bench.finish()


if __name__ == "__main__":
    main()
