"""--moe-tp-extend-ep as a feature: TP > 1, whole experts, and experts divisible by EP x TP
(the mechanism: tp_extend_ep.py; its patches: patches.py; its plan effect: plan.py)."""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.moe_tp_extend_ep import patches as _patches, plan as _plan
from npuspeed.features.moe_common.layout import Layout, needs_experts


@dataclass(frozen=True)
class Config(FeatureConfig):
    moe_tp_extend_ep: bool = flag("--moe-tp-extend-ep", False)
    """MindSpeed's flag: the tensor-parallel ranks serve as extra expert-parallel ranks (experts
    over EP x TP ranks, expert weights not split by TP)."""


class MoeTpExtendEpFeature(Feature, name="moe_tp_extend_ep", Config=Config, patches=_patches, plan=_plan,
                           switch="moe_tp_extend_ep"):
    def validate(self, ctx) -> None:
        lay = Layout.from_ctx(ctx, self.config(ctx.args).moe_tp_extend_ep)
        if lay.tp == 1:
            raise FeatureError("--moe-tp-extend-ep extends expert parallelism over the tensor-parallel ranks, but "
                               "--tensor-model-parallel-size is 1 (or not given): use TP > 1 or drop the flag")
        if lay.etp not in (None, 1):
            raise FeatureError(f"--moe-tp-extend-ep keeps each expert whole on a rank, but --expert-tensor-parallel-size "
                               f"is {lay.etp}: drop one of the two")
        if lay.experts is not None and lay.experts % (lay.ep * lay.tp):
            raise FeatureError(f"--moe-tp-extend-ep spreads the experts over EP x TP = {lay.ep} x {lay.tp} = "
                               f"{lay.ep * lay.tp} ranks, which does not divide --num-experts {lay.experts}; choose "
                               "a multiple of it or drop the flag")

    def check_built(self, block, ctx) -> str | None:
        return needs_experts("--moe-tp-extend-ep", block)

    def running(self, ctx) -> str:
        lay = Layout.from_ctx(ctx, self.config(ctx.args).moe_tp_extend_ep)
        return (f"experts over EP x TP = {lay.ep} x {lay.tp} ranks, expert-TP 1 (megatron.core expert layout "
                "set at initialize_model_parallel and on every TransformerConfig)")
