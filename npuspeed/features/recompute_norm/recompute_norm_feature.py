"""Norm recompute (`--recompute-norm [--recompute-norm-num-layers N]`, MindSpeed's names).

Each selected layer's input norm and pre-MLP norm outputs (tokens x hidden each) are kept
only because the next linear's backward reads them. Here they are computed without a graph,
freed once that linear has run and recomputed into the same storage just before its backward
(norms.py): two hidden-sized activations per layer, plus the norms' own saved statistics, go
for one norm's recompute in backward. The mechanism is activation recompute's checkpoint
(features/activation_checkpoint.py), reused with its own counters.
"""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.first_layers import FirstLayersFeature
from npuspeed.features.recompute_norm import patches as _patches, plan as _plan

MAIN, NUM = "--recompute-norm", "--recompute-norm-num-layers"


@dataclass(frozen=True)
class Config(FeatureConfig):
    recompute_norm: bool = flag(MAIN, False)
    """Free the input and pre-MLP norms' outputs once the next linear has used them and
    recompute them in backward (saves 2 x tokens x hidden per layer)."""
    recompute_norm_num_layers: int | None = flag(NUM, None, type=int, metavar="N")
    """With --recompute-norm: only the first N layers of each pipeline stage (interleaved order
    across virtual chunks); default all."""


class RecomputeNormFeature(FirstLayersFeature, name="recompute_norm", Config=Config, patches=_patches, plan=_plan,
                           switch="recompute_norm", requires={"recompute_norm_num_layers": "recompute_norm"},
                           recomputed="the norms",
                           mechanism="the activation-recompute checkpoint (Megatron-Core's CheckpointWithoutOutput, "
                                     "fp8=None): norm output freed after linear_qkv / linear_fc1 ran, recomputed "
                                     "from a grad hook on their output"):
    def selected(self) -> str:
        from npuspeed import telemetry
        from npuspeed.features.recompute_norm.norms import SELECTED

        return f"norms selected in this process: {telemetry.get(SELECTED)}"
