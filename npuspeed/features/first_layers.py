"""The "first N layers of each pipeline stage" option that --recompute-norm and
--recompute-activation-function share (`--<flag>-num-layers N`): its checks, its wording, and
which layers of a built TransformerBlock it selects (counted in interleaved order across
virtual chunks; Megatron's full recompute wins where it applies)."""
from __future__ import annotations

import math

from npuspeed.features.base import FeatureError


def check(num_flag: str, num: int | None, what: str) -> None:
    """`num_flag` is a positive number of layers (`what`: the recomputed thing); that it needs its
    main flag is the feature's `requires`."""
    if num is not None and num < 1:
        raise FeatureError(f"{num_flag} must be a positive number of layers per pipeline stage, got {num}; "
                           f"drop it to recompute {what} of every layer")


def per_stage(num: int | None) -> str:
    return "all layers" if num is None else f"first {num} layers of each pipeline stage"


def per_chunk(num: int | None) -> str:
    return "every layer" if num is None else f"the first {num} layers of each chunk"


def layers_per_stage(config) -> int:
    """Transformer layers per pipeline stage (the most a first-N-layers option can take)."""
    return math.ceil(config.num_layers / (config.pipeline_model_parallel_size or 1))


def check_num_layers(num_layers: int | None, config, flag: str, what: str) -> None:
    """`flag`'s N fits in a pipeline stage (`what`: the recomputed thing, for the message)."""
    per_stage = layers_per_stage(config)
    if num_layers is not None and num_layers > per_stage:
        raise FeatureError(
            f"{flag} {num_layers} is larger than the {per_stage} transformer layers per pipeline "
            f"stage (num_layers={config.num_layers} / pipeline_model_parallel_size="
            f"{config.pipeline_model_parallel_size or 1}); give at most {per_stage}, or drop it "
            f"to recompute {what} of every layer"
        )


def in_first_layers(block, index: int, num_layers: int | None) -> bool:
    """Whether layer `index` of this block is among the first `num_layers` of its pipeline
    stage, counted in interleaved order across virtual chunks (None: every layer)."""
    if num_layers is None:
        return True
    vpp = block.config.virtual_pipeline_model_parallel_size or 1
    return index * vpp + vp_stage(block) < num_layers


def vp_stage(block) -> int:
    """The virtual-pipeline chunk a TransformerBlock is."""
    stage = getattr(block, "vp_stage", None)
    if stage is None:  # megatron-core 0.12 builds chunks under the global virtual rank
        from megatron.core import parallel_state

        stage = parallel_state.get_virtual_pipeline_model_parallel_rank()
    return stage or 0


def fully_recomputed(config, index: int) -> bool:
    """Whether Megatron's full recompute (`recompute_granularity='full'`) covers layer `index`."""
    if config.recompute_granularity != "full":
        return False
    if config.recompute_method == "block":
        return index < (config.recompute_num_layers or 0)
    return True
