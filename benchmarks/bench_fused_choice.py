"""The fused ops' kernel table: every candidate of --use-fused-rmsnorm / -swiglu / -rotary-pos-emb
at one model's per-rank shapes, timed by the flags' own chooser, with its pick.

    python benchmarks/bench_fused_choice.py [--hidden 2048 --ffn 5632 --heads 16 --groups 4 --seq 4096]
                                            [--micro-batch 1] [--tp 1] [--dtypes bf16] [--json PATH]

Each row is npuspeed.ops.fused_table.measure: the ops' own `call(...)` handed to a fresh
fused-op chooser pointed at the accelerator (its synchronize and events, as the flags'
chooser is in a run), so the candidates (Megatron's path, Megatron's fused bias_swiglu,
npuspeed's kernel, torch.compile of Megatron's function, Liger-Kernel where installed, the
device's native op), the numerics check, the clock and the rule are what a training run at
these shapes gets: this table and the flags cannot disagree. torch.compile is a candidate on
accelerators (NPUSPEED_FUSED_OP_COMPILE=1 adds it on a CPU; its compile is the first call,
reported apart). Defaults: the device report's Llama model (hidden 2048, ffn 5632, GQA 16/4,
S 4096, micro-batch 1). `--json` writes the choices (the device report reads it).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=0, help="0: hidden / heads")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--json", default=None, help="write the table here")
    args = parser.parse_args(argv)

    from npuspeed.accelerator import get_accelerator
    from npuspeed.features.chooser_setup import on_accelerator
    from npuspeed.ops import fused_choice, fused_table

    acc = get_accelerator()
    model = fused_table.Model(hidden=args.hidden, ffn=args.ffn, heads=args.heads, groups=args.groups, seq=args.seq,
                              micro_batch=args.micro_batch, head_dim=args.head_dim, tp=args.tp)
    chooser = fused_choice.Chooser()
    on_accelerator(chooser, acc)  # the flags' chooser is configured so in a run (chooser_setup.configure)
    megatron = fused_table.megatron_functions()
    rows = []
    for name in args.dtypes.split(","):
        for choice in fused_table.measure(model, DTYPES[name], acc.device(), chooser):
            rows.append({**choice.as_dict(), "dtype": name, "line": choice.line()})
            print(f"[fused_choice] {choice.line()}", flush=True)
    out = {"device": acc.name, "model": vars(model) | {"kv_channels": model.kv_channels},
           "shapes": {k: list(v) for k, v in fused_table.shapes(model).items()},
           "megatron_stand_ins": sorted(k for k, v in megatron.items() if v is None),
           "compile": {"wanted": fused_choice.compile_wanted(torch.empty(1, device=acc.device())),
                       "failure": fused_choice.compile_failure()},
           "choices": rows}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
