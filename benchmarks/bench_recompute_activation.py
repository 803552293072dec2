"""Activation recompute benchmark: a 4-layer GPT step with and without --recompute-activation-function.

    python benchmarks/bench_recompute_activation.py [--hidden 256] [--seq 512] [--dtypes fp32 bf16]

One step = forward + backward of a Megatron-Core GPTModel (local spec, ffn = 4 x hidden,
dropout on) on a 1-rank gloo group. Baseline and feature are the same model: the feature's
MLPs are selected, the baseline's are not (the patched forward then runs Megatron's own).
Besides the harness's time and step peak, the memory held between the end of forward and
the start of backward is measured; both are reported against
A = layers x tokens x ffn_hidden x bytes, the activation outputs the feature frees.
"""
from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.nn.functional as F

from harness import Bench, init_single_rank_megatron

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ACTIVATIONS = {"gelu+bias": dict(gated_linear_unit=False, activation_func=F.gelu, add_bias_linear=True),
               "swiglu": dict(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)}


def _init_megatron():
    return init_single_rank_megatron(["--recompute-activation-function"])


def _gpt(args, dtype, activation):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden,
        num_attention_heads=args.heads, hidden_dropout=0.1, attention_dropout=0.1,
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        **ACTIVATIONS[activation])
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.vocab, max_sequence_length=args.seq)
    return Float16Module(config, model) if dtype == torch.bfloat16 else model


def _mlps(model):
    from megatron.core.transformer.mlp import MLP

    return [m for m in model.modules() if type(m) is MLP]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--activations", nargs="+", choices=sorted(ACTIVATIONS), default=sorted(ACTIVATIONS))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    bench = Bench("recompute_activation", warmup=args.warmup, repeat=args.repeat)
    _init_megatron()
    from npuspeed import telemetry
    from npuspeed.features.activation_checkpoint import PREFIX
    from npuspeed.features.recompute_activation.mlp import ATTR

    acc = bench.acc
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(bench.device)
    position_ids = torch.arange(args.seq, device=bench.device).expand(args.batch, args.seq)
    labels = torch.roll(tokens, -1, 1)
    for activation in args.activations:
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            model = _gpt(args, dtype, activation).to(bench.device)
            mlps = _mlps(model)
            assert len(mlps) == args.layers and all(getattr(m, ATTR, False) for m in mlps)

            def step(on: bool, held: list | None = None):
                def run():
                    for m in mlps:
                        setattr(m, ATTR, on)
                    model.zero_grad(set_to_none=True)
                    before = acc.memory_allocated()
                    loss = model(tokens, position_ids, None, labels=labels).float().mean()
                    if held is not None:
                        held.append(acc.memory_allocated() - before)
                    loss.backward()
                return run

            recomputed = telemetry.get(PREFIX + "recomputed")
            row = bench.compare(f"gpt {args.layers}L h={args.hidden} {activation}", dtype_name,
                                baseline=step(False), feature=step(True))
            assert telemetry.get(PREFIX + "recomputed") > recomputed, "the recompute path never ran"
            held_base, held_feat = [], []
            for fn in (step(False, held_base), step(True, held_feat)):
                model.zero_grad(set_to_none=True)
                gc.collect()
                fn()
            a = args.layers * args.seq * args.batch * 4 * args.hidden * torch.finfo(dtype).bits // 8
            row.extra.update({
                "A_bytes": a, "held_base_bytes": held_base[0], "held_feat_bytes": held_feat[0],
                "held_drop_over_A": round((held_base[0] - held_feat[0]) / a, 3),
                "peak_drop_over_A": round((row.baseline_peak_bytes - row.feature_peak_bytes) / a, 3),
                "time_ratio": round(row.speedup, 3), "threads": torch.get_num_threads(),
                "tokens": args.seq * args.batch, "torch": torch.__version__,
            })
            print(f"  A={a / 2**20:.1f} MiB: held {held_base[0] / 2**20:.1f} -> {held_feat[0] / 2**20:.1f} MiB "
                  f"(drop {row.extra['held_drop_over_A']} A), peak {row.baseline_peak_bytes / 2**20:.1f} -> "
                  f"{row.feature_peak_bytes / 2**20:.1f} MiB (drop {row.extra['peak_drop_over_A']} A), "
                  f"speed x{row.speedup:.3f}", flush=True)
            del model, mlps
            gc.collect()
    bench.finish()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    main()
