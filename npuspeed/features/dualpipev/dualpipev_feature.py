"""`--schedules-method dualpipev`: DualPipeV's V placement and schedule (megatron-core 0.14+),
refused in one line each where it cannot compose; with `--moe-fb-overlap` its paired steps run
taking turns at each expert all-to-all."""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.pipeline.v_placement import RANGE
from npuspeed.features.pipeline.which import microbatches_per_step, pairs_overlap, v_schedule
from npuspeed.features.dualpipev import patches as _patches, plan as _plan
from npuspeed.features.dualpipev.schedule import FLAG, batch_message
from npuspeed.patching.versions import in_range, megatron_version



@dataclass(frozen=True)
class Config(FeatureConfig):
    schedules_method: str | None = flag("--schedules-method", None, choices=["dualpipev"])
    """Pipeline schedule: 'dualpipev' places two chunks per pipeline rank in a V (rank r holds
    stages r and 2P-1-r: first and last stage on rank 0) and runs DualPipeV's order, whose steady
    steps pair a forward with a backward of another micro-batch (with --moe-fb-overlap their
    expert all-to-alls hide behind each other's compute). Needs megatron-core 0.14+,
    --num-layers-per-virtual-pipeline-stage = num-layers / (2 x PP), untied embeddings, and at
    least 2 x PP micro-batches a step."""


def _layers(m, pp: int) -> None:
    layers = m.num_layers
    if layers is None or layers % (2 * pp):
        raise FeatureError(f"{FLAG} splits the layers into 2 x {pp} stages: give --num-layers as a multiple of "
                           f"{2 * pp} (got {layers})")
    per = layers // (2 * pp)
    if m.num_layers_per_virtual_pipeline_stage != per or m.virtual_pipeline_model_parallel_size not in (None, 2):
        raise FeatureError(f"{FLAG} builds two model chunks per pipeline rank: add "
                           f"--num-layers-per-virtual-pipeline-stage {per} (num-layers / (2 x PP))")


def _refusals(m) -> list[tuple[bool, str]]:
    return [
        (not m.untie_embeddings_and_output_weights,
         f"{FLAG} puts the embedding and the output layer on rank 0 in two chunks; add "
         "--untie-embeddings-and-output-weights (a tied weight across chunks is not supported)"),
        (bool(m.pipeline_model_parallel_layout or m.decoder_first_pipeline_num_layers
              or m.decoder_last_pipeline_num_layers or m.account_for_embedding_in_pipeline_split
              or m.account_for_loss_in_pipeline_split),
         f"{FLAG} places layers evenly in a V; drop --pipeline-model-parallel-layout, "
         "--decoder-first/last-pipeline-num-layers and --account-for-*-in-pipeline-split"),
        ((m.context_parallel_size or 1) > 1,
         f"{FLAG} is not built for context parallelism: use --context-parallel-size 1 or Megatron's schedules"),
        (bool(m.mtp_num_layers), f"{FLAG} has no multi-token-prediction stage: drop --mtp-num-layers"),
        (bool(m.overlap_param_gather),
         f"{FLAG} runs its own order, which does not drive --overlap-param-gather's parameter all-gathers: drop it"),
    ]


class DualPipeVFeature(Feature, name="dualpipev", Config=Config, patches=_patches, plan=_plan):
    def enabled(self, args) -> bool:
        return v_schedule(args)  # the one answer, which the features that step aside for the V ask too

    def validate(self, ctx) -> None:
        m = ctx.megatron
        pp = m.pipeline_model_parallel_size or 1
        if pp < 2:
            raise FeatureError(f"{FLAG} places two chunks per pipeline rank in a V: it needs "
                               "--pipeline-model-parallel-size 2 or more")
        if not in_range(RANGE):
            raise FeatureError(f"{FLAG} builds its V from megatron-core 0.14+'s per-chunk layer offsets; this is "
                               f"{megatron_version()}: upgrade megatron-core or use Megatron's schedules")
        _layers(m, pp)
        for refused, message in _refusals(m):
            if refused:
                raise FeatureError(message)
        microbatches = microbatches_per_step(m)
        if microbatches is not None and microbatches < 2 * pp:
            raise FeatureError(batch_message(microbatches, pp))

    def running(self, ctx) -> str:
        how = ("taking turns at each expert all-to-all (--moe-fb-overlap)" if pairs_overlap(ctx.args)
               else "one after the other (add --moe-fb-overlap to overlap them)")
        return ("DualPipeV: rank r holds stages r and 2P-1-r (V placement through Megatron's layer offsets), "
                f"npuspeed's per-rank order and sends/receives; steady steps pair a forward and a backward, {how}")
