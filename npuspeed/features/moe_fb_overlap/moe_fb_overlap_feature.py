"""--moe-fb-overlap (and Megatron's --overlap-moe-expert-parallel-comm) as a feature: the
layouts the paired schedule serves, refused one line each where it cannot compose."""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.moe_fb_overlap import patches as _patches, plan as _plan
from npuspeed.features.moe_common.layout import built_all_to_all, needs_all_to_all
from npuspeed.features.moe_fb_overlap import interleaved
from npuspeed.features.pipeline.which import microbatches_per_step, pairs_overlap
from npuspeed.patching.versions import in_range, megatron_version


@dataclass(frozen=True)
class Config(FeatureConfig):
    moe_fb_overlap: bool = flag("--moe-fb-overlap", False)
    """MoE expert parallelism: run the backward of one micro-batch beside the forward of the next,
    so each one's compute hides the other's dispatch/combine all-to-alls (PP 1: two or more
    micro-batches; PP > 1: with VPP on megatron-core 0.14+, more micro-batches than stages)."""
    overlap_moe_expert_parallel_comm: bool = flag("--overlap-moe-expert-parallel-comm", False)
    """Megatron's flag (0.14+): with npuspeed it runs --moe-fb-overlap's schedule, on every backend,
    without Transformer Engine, in fp32 too."""
    # dualpipev's flag (it owns it: no --help here): DualPipeV's schedule then pairs the steps itself
    schedules_method: str | None = None
    # moe_alltoall_overlap's flag (refused with this one) and moe_tp_extend_ep's (the expert layout)
    moe_alltoall_overlap_comm: bool = False
    moe_tp_extend_ep: bool = False

    @property
    def flag_given(self) -> str:
        return "--moe-fb-overlap" if self.moe_fb_overlap else "--overlap-moe-expert-parallel-comm"


def _pipeline(flag: str, pp: int, m) -> None:
    """PP > 1 runs Megatron's interleaved schedule with its extra warm-up micro-batch (0.14+):
    refused where that is missing, as given on the command line (the schedule checks the rest)."""
    if not in_range(interleaved.RANGE):
        raise FeatureError(f"{flag} at --pipeline-model-parallel-size {pp} runs on the interleaved schedule's "
                           f"extra warm-up micro-batch, which megatron-core 0.14+ has; this is "
                           f"{megatron_version()}: upgrade megatron-core to 0.14+ or use --pipeline-model-parallel-size 1")
    vpp = getattr(m, "num_layers_per_virtual_pipeline_stage", None) or \
        getattr(m, "virtual_pipeline_model_parallel_size", None)
    if not vpp:
        raise FeatureError(interleaved.no_vpp_message(flag, pp))
    microbatches = microbatches_per_step(m)
    if microbatches is not None and microbatches <= pp:
        raise FeatureError(interleaved.batch_message(flag, microbatches, pp))


class MoeFbOverlapFeature(Feature, name="moe_fb_overlap", Config=Config, patches=_patches, plan=_plan):
    def enabled(self, args) -> bool:
        return pairs_overlap(args)  # the one answer, which DualPipeV and the bubble baseline ask too

    def validate(self, ctx) -> None:
        config = self.config(ctx.args)
        flag_ = config.flag_given
        m = ctx.megatron
        if config.moe_alltoall_overlap_comm:
            raise FeatureError(f"{flag_} hides the all-to-all behind another micro-batch; --moe-alltoall-overlap-comm "
                               "chunks the same all-to-all inside one: choose one of the two")
        needs_all_to_all(flag_, ctx, config.moe_tp_extend_ep)
        pp = m.pipeline_model_parallel_size or 1
        if pp > 1:
            _pipeline(flag_, pp, m)
        if getattr(m, "recompute_granularity", None) == "full":
            raise FeatureError(f"{flag_}: full recompute re-runs the layer's all-to-alls inside the backward, where "
                               "the turn would pass mid-recompute; use --recompute-granularity selective or drop it")
        if "moe" in (getattr(m, "recompute_modules", None) or ()):
            raise FeatureError(f"{flag_}: '--recompute-modules moe' re-runs the all-to-alls inside the backward; "
                               "drop 'moe' from --recompute-modules")
        if getattr(m, "moe_shared_expert_overlap", None):
            raise FeatureError(f"{flag_} schedules the shared experts itself; drop Megatron's "
                               "--moe-shared-expert-overlap")

    def check_built(self, block, ctx) -> str | None:
        return built_all_to_all(self.config(ctx.args).flag_given, block)

    def running(self, ctx) -> str:
        acc = ctx.accelerator
        where = ("async gloo work, waited after the turn passes" if not for_device(acc.name).has_streams()
                 else f"async {acc.dist_backend} collectives on the backend's communication stream")
        if (ctx.megatron.pipeline_model_parallel_size or 1) > 1:
            return ("Megatron's interleaved schedule with one extra warm-up micro-batch: each steady step's "
                    "backward on a worker thread beside its forward, the turn passed at each token all-to-all "
                    f"({where}); hidden share: a2a_hidden_fraction")
        return ("PP-1 schedule: micro-batch i's backward on a worker thread beside micro-batch i+1's forward, "
                f"the turn passed at each token all-to-all ({where}); hidden share: a2a_hidden_fraction")
