"""`npuspeed convert hf-to-megatron ...` and `npuspeed convert megatron-to-hf ...`."""
from __future__ import annotations

import argparse
import sys


def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    upper = text.strip().upper()
    for unit, factor in sorted(units.items(), key=lambda u: -len(u[0])):
        if upper.endswith(unit):
            return int(float(upper[: -len(unit)]) * factor)
    return int(upper)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="npuspeed convert", description="Hugging Face <-> Megatron "
                                     "(local spec, dist_checkpointing) checkpoints; see docs/convert.md")
    sub = parser.add_subparsers(dest="direction", required=True)
    h2m = sub.add_parser("hf-to-megatron", help="a Hugging Face directory to a checkpoint --load resumes from")
    h2m.add_argument("--hf", required=True, help="the Hugging Face model directory (config.json, safetensors)")
    h2m.add_argument("--save", required=True, help="the new checkpoint directory (must not exist)")
    h2m.add_argument("--tensor-model-parallel-size", type=int, default=1)
    h2m.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    h2m.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    h2m.add_argument("--expert-model-parallel-size", type=int, default=1)
    h2m.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                     help="ranks each expert is split over (default: the TP size)")
    h2m.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                     help="the vocabulary is padded to a multiple of this x TP (Megatron-LM's default 128)")
    h2m.add_argument("--drop-mtp-layers", action="store_true", help="DeepSeek-V3: leave out the multi-token-"
                     "prediction layers' tensors (transformers' forward does not use them)")
    precision = h2m.add_mutually_exclusive_group()
    for name in ("bf16", "fp16", "fp32"):
        precision.add_argument(f"--{name}", dest="precision", action="store_const", const=name,
                               help="store the weights in this precision (default: config.json's dtype)")
    m2h = sub.add_parser("megatron-to-hf", help="a checkpoint of any layout to a Hugging Face directory")
    m2h.add_argument("--load", required=True, help="the checkpoint directory (iter_NNNNNNN/ and the tracker)")
    m2h.add_argument("--save", required=True, help="the new Hugging Face directory (must not exist)")
    m2h.add_argument("--ckpt-step", type=int, default=None, help="this iteration instead of the latest")
    m2h.add_argument("--hf-config", default=None, help="the original model's config.json (or its directory); "
                     "default: the one hf-to-megatron stored in the checkpoint")
    m2h.add_argument("--max-shard-size", type=_size, default=5 * 10**9, help="bytes per safetensors shard "
                     "(e.g. 5GB, 200MB)")
    return parser


def main(argv: list[str]) -> int:
    from npuspeed.errors import exit_on_user_error

    args = build_parser().parse_args(argv)
    with exit_on_user_error():
        if args.direction == "hf-to-megatron":
            from npuspeed.convert import hf_to_megatron

            done = hf_to_megatron.convert(
                args.hf, args.save, tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                vpp_layers=args.num_layers_per_virtual_pipeline_stage, ep=args.expert_model_parallel_size,
                etp=args.expert_tensor_parallel_size,
                divisible_by=args.make_vocab_size_divisible_by, precision=args.precision,
                drop_mtp=args.drop_mtp_layers)
            if done["dropped"]:
                print(f"npuspeed convert: left out {done['dropped']} multi-token-prediction tensors (--drop-mtp-layers)")
            print(f"npuspeed convert: {done['spec'].architecture} -> {done['save']} (iteration 0, padded "
                  f"vocabulary {done['padded_vocab_size']})")
            print(f"Megatron flags (also in {done['save']}/{hf_to_megatron.ARGS_FILE}):")
            print(" ".join(done["flags"]))
            print(f"resume with: --load {done['save']} --no-load-optim")
        else:
            from npuspeed.convert import megatron_to_hf

            done = megatron_to_hf.convert(args.load, args.save, hf_config=args.hf_config, step=args.ckpt_step,
                                          max_shard_bytes=args.max_shard_size)
            print(f"npuspeed convert: {args.load} -> {done['save']} ({done['tensors']} tensors in "
                  f"{done['shards']} shard(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
