"""--moe-alltoall-overlap-comm [--moe-alltoall-chunks N] as a feature: the layouts the chunked
all-to-all needs (the all-to-all dispatcher, expert parallelism, whole experts per rank). The
chunked layer: overlap.py with pipeline.py and a2a.py; patches.py; plan.py."""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.moe_alltoall_overlap import patches as _patches, plan as _plan
from npuspeed.features.moe_alltoall_overlap import overlap
from npuspeed.features.moe_common.layout import Layout, built_all_to_all, needs_all_to_all, needs_release


@dataclass(frozen=True)
class Config(FeatureConfig):
    moe_alltoall_overlap_comm: bool = flag("--moe-alltoall-overlap-comm", False)
    """All-to-all dispatcher: dispatch and combine in chunks overlapped with the experts' compute,
    shared experts computed while the first chunk is in flight."""
    moe_alltoall_chunks: int | None = flag("--moe-alltoall-chunks", None, type=int)
    """With --moe-alltoall-overlap-comm: chunks per MoE layer (>= 2, default 2)."""
    # moe_tp_extend_ep's flag (it owns it: no --help here): the expert layout it changes
    moe_tp_extend_ep: bool = False

    @property
    def chunks(self) -> int:
        return self.moe_alltoall_chunks or 2


class MoeAllToAllOverlapFeature(Feature, name="moe_alltoall_overlap", Config=Config, patches=_patches, plan=_plan,
                                switch="moe_alltoall_overlap_comm",
                                requires={"moe_alltoall_chunks": "moe_alltoall_overlap_comm"}):
    def chunks(self, ctx) -> int:
        return self.config(ctx.args).chunks

    def validate(self, ctx) -> None:
        config = self.config(ctx.args)
        self.check_requires(config)
        needs_release("--moe-alltoall-overlap-comm", overlap.MEGATRON_RANGE, "MoELayer's route/preprocess/dispatch steps")
        if self.chunks(ctx) < 2:
            raise FeatureError(f"--moe-alltoall-chunks must be >= 2 (got {config.moe_alltoall_chunks}): one chunk "
                               "leaves the all-to-all nothing to overlap with")
        needs_all_to_all("--moe-alltoall-overlap-comm", ctx, config.moe_tp_extend_ep)
        lay = Layout.from_ctx(ctx, config.moe_tp_extend_ep)
        if lay.expert_tp > 1:
            raise FeatureError(f"--moe-alltoall-overlap-comm chunks whole token rows, but experts are split over "
                               f"{lay.expert_tp} tensor-parallel ranks; add --moe-tp-extend-ep or "
                               "--expert-tensor-parallel-size 1")
        if getattr(ctx.megatron, "moe_shared_expert_overlap", None):
            raise FeatureError("--moe-alltoall-overlap-comm computes the shared experts during the all-to-all itself; "
                               "drop Megatron's --moe-shared-expert-overlap")

    def check_built(self, block, ctx) -> str | None:
        return built_all_to_all("--moe-alltoall-overlap-comm", block)

    def running(self, ctx) -> str:
        acc = ctx.accelerator
        where = ("async work handles on gloo, waited per chunk" if not for_device(acc.name).has_streams()
                 else f"async {acc.dist_backend} collectives on the backend's communication stream")
        return (f"MoELayer.forward: dispatch/experts/combine in {self.chunks(ctx)} chunks, {where}; shared experts "
                "during the first chunk's all-to-all")
