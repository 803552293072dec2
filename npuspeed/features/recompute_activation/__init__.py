"""Activation-function recompute (`--recompute-activation-function
[--recompute-activation-function-num-layers N]`).

The MLP's activation output (tokens x ffn_hidden per layer) is kept only because fc2's
backward reads it. Here it is computed without a graph, its storage released once fc2 has
saved it, and recomputed into the same storage by a hook on fc2's output, just before fc2's
backward runs: the activation memory of the selected layers goes for one extra activation
per layer in backward. Built on Megatron-Core's own CheckpointWithoutOutput (checkpoint.py),
the MLP path (mlp.py) and the choice of layers (layers.py).
"""
from __future__ import annotations

from npuspeed.features.base import Feature, FeatureError

MAIN, NUM = "--recompute-activation-function", "--recompute-activation-function-num-layers"


class RecomputeActivationFeature(Feature):
    name = "recompute_activation"
    flags = (MAIN, NUM)

    def add_arguments(self, group) -> None:
        group.add_argument(MAIN, action="store_true",
                           help="Free the MLP activation's output after fc2 used it and recompute it "
                                "in backward (saves tokens x ffn_hidden per layer).")
        group.add_argument(NUM, type=int, default=None, metavar="N",
                           help=f"With {MAIN}: only the first N layers of each pipeline stage "
                                "(interleaved order across virtual chunks); default all.")

    def enabled(self, args) -> bool:
        # N alone counts as asking for the feature, so that validate() can refuse it clearly.
        return bool(getattr(args, "recompute_activation_function", False)) or \
            getattr(args, "recompute_activation_function_num_layers", None) is not None

    def validate(self, ctx) -> None:
        args = ctx.args
        num = getattr(args, "recompute_activation_function_num_layers", None)
        if not getattr(args, "recompute_activation_function", False):
            raise FeatureError(f"{NUM} {num} is given without {MAIN}; add {MAIN} (or drop {NUM})")
        if num is not None and num < 1:
            raise FeatureError(
                f"{NUM} must be a positive number of layers per pipeline stage, got {num}; "
                f"drop it to recompute the activation of every layer"
            )

    def register_patches(self, registry, ctx) -> None:
        from npuspeed.features.recompute_activation import layers, mlp

        registry.register(mlp.TARGET, wrapper=mlp.recompute_activation, feature=self.name)
        registry.register(layers.TARGET, wrapper=layers.selector(
            ctx.args.recompute_activation_function_num_layers, ctx.note), feature=self.name)

    def path(self, ctx) -> str:
        args = ctx.args
        if not getattr(args, "recompute_activation_function", False):
            return "off"
        from npuspeed import telemetry
        from npuspeed.features.recompute_activation.layers import SELECTED

        num = args.recompute_activation_function_num_layers
        which = "all layers" if num is None else f"first {num} layers of each pipeline stage"
        return (f"megatron.core.tensor_parallel.CheckpointWithoutOutput, reused (fp8=None; storage "
                f"resize_(0) after fc2, recompute from a grad hook on fc2's output, early release of "
                f"fc1's output and the recomputed copy); {which}; MLPs selected in this process: "
                f"{telemetry.get(SELECTED)}")


__all__ = ["RecomputeActivationFeature", "FeatureError"]
