"""The "first N layers of each pipeline stage" option that --recompute-norm and
--recompute-activation-function share (`--<flag>-num-layers N`): its checks, its wording, the
feature class and plan effect around it, and which layers of a built TransformerBlock it
selects (counted in interleaved order across virtual chunks; Megatron's full recompute wins
where it applies)."""
from __future__ import annotations

import math

from npuspeed.features.base import Feature, FeatureError, PlanEffect, flag_of


class FirstLayersFeature(Feature):
    """The class both recompute features are: a main flag (`switch`) and its
    `--<flag>-num-layers N`, the one option of `requires`, checked alike; the report's line is
    `<mechanism>; <which layers>; <selected(): what this process selected>`."""
    #: the recomputed thing, in messages ("the norms")
    recomputed: str = ""
    #: how it is recomputed, the report line's first part
    mechanism: str = ""

    def num_layers(self, config) -> int | None:
        (option,) = self.requires
        return getattr(config, option)

    def validate(self, ctx) -> None:
        config = self.config(ctx.args)
        self.check_requires(config)
        (option,) = self.requires
        check(flag_of(config, option), self.num_layers(config), self.recomputed)

    def running(self, ctx) -> str:
        config = self.config(ctx.args)
        if not getattr(config, self.switch):
            return "off"
        return f"{self.mechanism}; {per_stage(self.num_layers(config))}; {self.selected()}"

    def selected(self) -> str:
        """What this process selected so far, for the report ("MLPs selected in this process: 4")."""
        raise NotImplementedError


def recompute_effect(variant: str, num_layers: int | None, summary: str) -> PlanEffect:
    """The plan effect of recomputing the op-graph variant `variant` (npuspeed/plan/ops.py) in the
    first `num_layers` layers of each chunk (None: every layer)."""
    return PlanEffect(variants={variant: "recompute"}, variant_layers={variant: num_layers}, summary=summary)


def layers_taken(block, num_layers: int | None, note, flags: tuple[str, str], recomputed: str, offload_reads: str):
    """(index, layer) of each layer of a built block among its stage's first `num_layers`, after
    checking that N fits the stage; none, said once through `note`, where activations are
    offloaded to the host. `flags`: the main flag and its num-layers flag; `recomputed`: what the
    feature recomputes ("the norms"); `offload_reads`: what the offload hooks would read of it."""
    config = block.config
    main, num_flag = flags
    check_num_layers(num_layers, config, num_flag, recomputed)
    if getattr(config, "cpu_offloading", False) or getattr(config, "fine_grained_activation_offloading", False):
        note(f"{main}: off where activations are offloaded to the host (cpu_offloading / "
             f"fine_grained_activation_offloading): the offload hooks read {offload_reads}")
        return
    for index, layer in enumerate(getattr(block, "layers", ())):
        if in_first_layers(block, index, num_layers):
            yield index, layer


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
