"""The compute floor of the example's step at a given model (npuspeed/compute_floor.py): every
GEMM and attention call of one step on one rank, each timed alone on the device, summed.

Takes the example's own model flags (after `--`), read by the example's parser, so the shapes,
the padded vocabulary, the micro-batches per step and the dtype are the run's:

    python benchmarks/compute_floor.py [--json out.json] [--threads 1] -- --num-layers 8 ... --bf16
    python benchmarks/compute_floor.py --world-size 2 -- ... --tensor-model-parallel-size 2

`--world-size` is the run's rank count (micro-batches per step = global batch / (micro-batch x
DP)). On CPU, `--threads` should be what one rank of the run had (the launcher gives each
rank OMP_NUM_THREADS=1). Prints the floor, its TFLOP/s and MFU (with a known or given peak).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def example_args(argv: list[str], world_size: int):
    """The example's argument namespace for `argv`, with the padded vocabulary it trains with."""
    os.environ["WORLD_SIZE"] = str(world_size)
    from gpt_example.args import parse_args
    from gpt_example.data import build_tokenizer
    from npuspeed.convert import layout  # the example's padding (gpt_example.model), without GPTModel's imports

    args = parse_args(argv)
    vocab = build_tokenizer(args).vocab_size
    args.padded_vocab_size = layout.padded_vocab_size(vocab, args.make_vocab_size_divisible_by,
                                                      args.tensor_model_parallel_size)
    return args


def floor_of(args, world_size: int, repeats: int | None = None, clock: str = "wall") -> dict:
    import torch

    from npuspeed import compute_floor, get_accelerator, throughput

    acc = get_accelerator()
    tp = args.tensor_model_parallel_size
    dp = world_size // (tp * args.pipeline_model_parallel_size * args.context_parallel_size)
    if args.pipeline_model_parallel_size > 1 or args.context_parallel_size > 1:
        raise SystemExit("compute_floor.py: PP and CP layouts are not enumerated (TP and DP are)")
    gbs = args.global_batch_size or args.micro_batch_size * dp
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    peak = args.device_peak_tflops or throughput.peak_tflops(acc.device_name())
    result = compute_floor.floor(throughput.from_args(args), micro_batch=args.micro_batch_size,
                                 micro_batches=gbs // (args.micro_batch_size * dp), tp=tp, device=acc.device(),
                                 synchronize=acc.synchronize, dtype=dtype, dropout_p=args.attention_dropout,
                                 peak_tflops=peak, repeats=repeats,
                                 clock=time.process_time if clock == "cpu" else time.perf_counter)
    result.update(clock=clock, device=acc.name, device_name=acc.device_name(), world_size=world_size, global_batch=gbs,
                  model_flops_per_iteration=throughput.model_flops(throughput.from_args(args), gbs))
    return result


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, model = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the floor (every call's timing) here")
    parser.add_argument("--world-size", type=int, default=1, help="the run's ranks (default 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on a CPU (default: torch's)")
    parser.add_argument("--repeats", type=int, default=None, help="timings per call (default: 3 on CPU, 5 on a device)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time (a shared host; compare with a run's CPU time per step)")
    opts = parser.parse_args(ours)
    import torch

    if opts.threads:
        torch.set_num_threads(opts.threads)
    result = floor_of(example_args(model, opts.world_size), opts.world_size, opts.repeats, opts.clock)
    result.update(argv=model, threads=torch.get_num_threads())
    mfu = f", MFU {result['mfu']:.1%} of {result['peak_tflops']:g}" if result["mfu"] is not None else ""
    print(f"compute floor: {result['floor_ms']:.1f} ms a step per rank (GEMMs {result['ms_by_kind']['gemm']:.1f}, "
          f"attention {result['ms_by_kind']['attention']:.1f}; {result['micro_batches']} micro-batches, TP "
          f"{result['tp']}, {result['dtype']}), {result['tflops']:.3g} TFLOP/s{mfu} on {result['device_name']}")
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
