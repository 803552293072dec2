"""Activation-function recompute (`--recompute-activation-function
[--recompute-activation-function-num-layers N]`).

The MLP's activation output (tokens x ffn_hidden per layer) is kept only because fc2's
backward reads it. Here it is computed without a graph, its storage released once fc2 has
saved it, and recomputed into the same storage by a hook on fc2's output, just before fc2's
backward runs: the activation memory of the selected layers goes for one extra activation
per layer in backward. Built on Megatron-Core's own CheckpointWithoutOutput (features/activation_checkpoint.py),
the MLP path (mlp.py) and the choice of layers (layers.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.first_layers import FirstLayersFeature
from npuspeed.features.recompute_activation import patches as _patches, plan as _plan

MAIN, NUM = "--recompute-activation-function", "--recompute-activation-function-num-layers"


@dataclass(frozen=True)
class Config(FeatureConfig):
    recompute_activation_function: bool = flag(MAIN, False)
    """Free the MLP activation's output after fc2 used it and recompute it in backward (saves
    tokens x ffn_hidden per layer)."""
    recompute_activation_function_num_layers: int | None = flag(NUM, None, type=int, metavar="N")
    """With --recompute-activation-function: only the first N layers of each pipeline stage
    (interleaved order across virtual chunks); default all."""


class RecomputeActivationFeature(FirstLayersFeature, name="recompute_activation", Config=Config, patches=_patches,
                                 plan=_plan, switch="recompute_activation_function",
                                 requires={"recompute_activation_function_num_layers":
                                           "recompute_activation_function"},
                                 recomputed="the activation",
                                 mechanism="megatron.core.tensor_parallel.CheckpointWithoutOutput, reused (fp8=None; "
                                           "storage resize_(0) after fc2, recompute from a grad hook on fc2's "
                                           "output, early release of fc1's output and the recomputed copy)"):
    def selected(self) -> str:
        from npuspeed import telemetry
        from npuspeed.features.recompute_activation.layers import SELECTED

        return f"MLPs selected in this process: {telemetry.get(SELECTED)}"
