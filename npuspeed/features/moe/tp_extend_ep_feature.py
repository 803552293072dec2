"""--moe-tp-extend-ep as a feature: TP > 1, whole experts, and experts divisible by EP x TP."""
from __future__ import annotations

from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.moe import tp_extend_ep
from npuspeed.features.moe.layout import Layout, needs_experts


class TpExtendEpFeature(Feature):
    name = "moe_tp_extend_ep"
    flags = ("--moe-tp-extend-ep",)

    def add_arguments(self, group) -> None:
        group.add_argument("--moe-tp-extend-ep", action="store_true",
                           help="MindSpeed's flag: the tensor-parallel ranks serve as extra expert-parallel ranks "
                                "(experts over EP x TP ranks, expert weights not split by TP).")

    def enabled(self, args) -> bool:
        return bool(getattr(args, "moe_tp_extend_ep", False))

    def validate(self, ctx) -> None:
        lay = Layout.from_ctx(ctx)
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

    def register_patches(self, registry, ctx) -> None:
        tp_extend_ep.register(registry, self.name)

    def check_built(self, block, ctx) -> str | None:
        return needs_experts("--moe-tp-extend-ep", block)

    def plan_effect(self, model, ctx):
        """Experts over EP x TP ranks, each whole (expert TP 1): fewer, unsplit experts per rank."""
        from npuspeed.features.base import PlanEffect

        lay = model.layout
        if not model.model.num_experts or lay.tp < 2:
            return None
        return PlanEffect(options={"moe_ep": lay.ep * lay.tp, "moe_etp": 1},
                          summary=f"experts over EP x TP = {lay.ep * lay.tp} ranks, each whole on one rank "
                                  "(no expert-TP all-gather of tokens)")

    def path(self, ctx) -> str:
        if not self.enabled(ctx.args):
            return "off"
        lay = Layout.from_ctx(ctx)
        return (f"experts over EP x TP = {lay.ep} x {lay.tp} ranks, expert-TP 1 (megatron.core expert layout "
                "set at initialize_model_parallel and on every TransformerConfig)")
