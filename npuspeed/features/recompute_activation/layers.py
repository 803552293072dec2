"""Which MLPs recompute their activation: the first N layers of each pipeline stage.

Chosen when a TransformerBlock (one pipeline stage, or one virtual chunk of it) is built, from
the layer's position in the block. With virtual pipeline chunks a stage runs its chunks in
turn, so its layers are taken in interleaved order: position i of chunk v has rank
i * vpp + v, and the N lowest ranks are selected (N = 2, 2 chunks: the first layer of each).

Skipped, and said once in the log and the report:
* layers under full recompute (`recompute_granularity='full'`: every layer with method
  'uniform', the first recompute_num_layers with 'block'): the whole layer is recomputed
  anyway, so full wins; likewise an MLP recomputed whole by selective `recompute_modules=['mlp']`;
* MoE layers: expert MLPs scale by per-token router probabilities and see variable token
  counts; Megatron-Core's own `recompute_modules=['moe_act']` covers their activation;
* everything when activations are offloaded to the host (`cpu_offloading`,
  `fine_grained_activation_offloading`): the offload hooks may still read the tensor whose
  storage we would release.
"""
from __future__ import annotations

from npuspeed import telemetry
from npuspeed.features.base import after_init
from npuspeed.features.first_layers import fully_recomputed, layers_taken

TARGET = "megatron.core.transformer.transformer_block.TransformerBlock.__init__"
MAIN, FLAG = "--recompute-activation-function", "--recompute-activation-function-num-layers"
#: counter: MLPs selected in this process (for the report and the tests)
SELECTED = "recompute.selected"


def select(block, num_layers: int | None, note) -> None:
    """Mark this block's MLPs that recompute; `note` records each reason a layer is skipped."""
    from megatron.core.transformer.mlp import MLP

    from npuspeed.features.recompute_activation.mlp import ATTR

    config = block.config
    for index, layer in layers_taken(block, num_layers, note, (MAIN, FLAG), "the activation", "them"):
        mlp = getattr(layer, "mlp", None)
        if not (isinstance(mlp, MLP) and type(mlp).forward is MLP.forward):
            if mlp is not None and type(mlp).__name__ != "IdentityOp":
                note(
                    "--recompute-activation-function: MoE/expert MLPs are not covered (per-token "
                    "router scales, variable token counts); Megatron-Core's recompute_modules="
                    "['moe_act'] recomputes expert activations"
                )
            continue
        if fully_recomputed(config, index):
            note(
                "--recompute-activation-function: --recompute-granularity full recomputes whole "
                "layers; full recompute wins and those layers keep Megatron's behaviour"
            )
            continue
        if getattr(layer, "recompute_mlp", False):
            note(
                "--recompute-activation-function: selective recompute of 'mlp' recomputes the "
                "whole MLP; it wins in those layers"
            )
            continue
        setattr(mlp, ATTR, True)
        telemetry.count(SELECTED)


def selector(num_layers: int | None, note):
    """Wrapper for TransformerBlock.__init__: select this block's MLPs once it is built."""
    return after_init(select, num_layers, note)
