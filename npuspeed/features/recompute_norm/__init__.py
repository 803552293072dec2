"""Norm recompute (`--recompute-norm [--recompute-norm-num-layers N]`, MindSpeed's names).

Each selected layer's input norm and pre-MLP norm outputs (tokens x hidden each) are kept
only because the next linear's backward reads them. Here they are computed without a graph,
freed once that linear has run and recomputed into the same storage just before its backward
(norms.py): two hidden-sized activations per layer, plus the norms' own saved statistics, go
for one norm's recompute in backward. The mechanism is activation recompute's checkpoint
(recompute_activation/checkpoint.py), reused with its own counters.
"""
from __future__ import annotations

from npuspeed.features.base import Feature, FeatureError

MAIN, NUM = "--recompute-norm", "--recompute-norm-num-layers"


class RecomputeNormFeature(Feature):
    name = "recompute_norm"
    flags = (MAIN, NUM)

    def add_arguments(self, group) -> None:
        group.add_argument(MAIN, action="store_true",
                           help="Free the input and pre-MLP norms' outputs once the next linear has used "
                                "them and recompute them in backward (saves 2 x tokens x hidden per layer).")
        group.add_argument(NUM, type=int, default=None, metavar="N",
                           help=f"With {MAIN}: only the first N layers of each pipeline stage "
                                "(interleaved order across virtual chunks); default all.")

    def enabled(self, args) -> bool:
        return bool(getattr(args, "recompute_norm", False)) or getattr(args, "recompute_norm_num_layers", None) is not None

    def validate(self, ctx) -> None:
        args = ctx.args
        num = getattr(args, "recompute_norm_num_layers", None)
        if not getattr(args, "recompute_norm", False):
            raise FeatureError(f"{NUM} {num} is given without {MAIN}; add {MAIN} (or drop {NUM})")
        if num is not None and num < 1:
            raise FeatureError(f"{NUM} must be a positive number of layers per pipeline stage, got {num}; "
                               "drop it to recompute the norms of every layer")

    def register_patches(self, registry, ctx) -> None:
        from npuspeed.features.recompute_norm import norms

        registry.register(norms.TARGET, wrapper=norms.selector(ctx.args.recompute_norm_num_layers, ctx.note),
                          feature=self.name)

    def plan_effect(self, model, ctx):
        from npuspeed.features.base import PlanEffect

        n = ctx.args.recompute_norm_num_layers
        which = "every layer" if n is None else f"the first {n} layers of each chunk"
        return PlanEffect(
            variants={"norm_output": "recompute"}, variant_layers={"norm_output": n},
            summary=f"the input and pre-MLP norm outputs (2 x tokens x hidden) and the norms' statistics of "
                    f"{which} are not held between forward and backward; one norm is recomputed at a time")

    def path(self, ctx) -> str:
        args = ctx.args
        if not getattr(args, "recompute_norm", False):
            return "off"
        from npuspeed import telemetry
        from npuspeed.features.recompute_norm.norms import SELECTED

        num = args.recompute_norm_num_layers
        which = "all layers" if num is None else f"first {num} layers of each pipeline stage"
        return (f"the activation-recompute checkpoint (Megatron-Core's CheckpointWithoutOutput, fp8=None): norm "
                f"output freed after linear_qkv / linear_fc1 ran, recomputed from a grad hook on their output; "
                f"{which}; norms selected in this process: {telemetry.get(SELECTED)}")


__all__ = ["RecomputeNormFeature", "FeatureError"]
