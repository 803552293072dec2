"""FP8 training without Transformer Engine: Megatron's `--fp8-format` / `--fp8-recipe` on the
local spec (issue 50).

Megatron-Core runs FP8 only through TE's layers. With this flag the linears inside the
transformer layers (attention's QKV and projection, the MLP's and the experts' FC1/FC2, i.e.
every ColumnParallelLinear / RowParallelLinear a layer calls) run npuspeed's FP8 linear
(npuspeed/ops/fp8: the forward, input-gradient and weight-gradient GEMMs in FP8 with the
recipe's scaling); attention, norms, softmax, the embedding, the output layer and the loss keep
their precision, as under TE. The example builds Megatron's TransformerConfig without `fp8`, so
Megatron's TE-only FP8 code never runs. Only the CPU backend runs it so far (the GEMMs are the
exact emulation); CUDA and NPU are refused in one line. The patches: patches.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.fp8 import patches as _patches
from npuspeed.ops.fp8.recipe import RECIPES

FLAG = "--fp8-format"


@dataclass(frozen=True)
class Config(FeatureConfig):
    fp8: str | None = flag(FLAG, None, choices=("e4m3", "hybrid"))
    """FP8 for the transformer layers' linear GEMMs (Megatron's flag, run by npuspeed without
    Transformer Engine): e4m3 everywhere, or hybrid (E4M3 forward, E5M2 gradients)."""
    fp8_recipe: str = flag("--fp8-recipe", "delayed", choices=RECIPES)
    """How FP8 scales are chosen (Megatron's default: delayed): tensorwise (current per-tensor amax),
    delayed (amax history), blockwise (1x128 activations/gradients, 128x128 weights), mxfp8 (OCP MX:
    32-element blocks, E8M0 scales)."""
    fp8_margin: int = flag("--fp8-margin", 0, type=int)
    """Delayed scaling: the scale is (FP8 max / amax) / 2**margin."""
    fp8_amax_history_len: int = flag("--fp8-amax-history-len", 1, type=int)
    """Delayed scaling: how many past amaxes the scale is computed from."""
    fp8_amax_compute_algo: str = flag("--fp8-amax-compute-algo", "most_recent", choices=("max", "most_recent"))
    """Delayed scaling: the amax used, the largest of the history (max) or the latest (most_recent)."""
    no_fp8_wgrad: bool = flag("--no-fp8-wgrad", False)
    """Compute the weight gradients in fp32 instead of FP8."""
    first_last_layers_bf16: bool = flag("--first-last-layers-bf16", False)
    """Keep the first and last transformer layers out of FP8 (their linears keep Megatron's GEMMs)."""
    num_layers_at_start_in_bf16: int = flag("--num-layers-at-start-in-bf16", 1, type=int)
    """With --first-last-layers-bf16: how many layers at the start stay out of FP8."""
    num_layers_at_end_in_bf16: int = flag("--num-layers-at-end-in-bf16", 1, type=int)
    """With --first-last-layers-bf16: how many layers at the end stay out of FP8."""
    # other features' flags this one must know (read, not defined here)
    use_coc: bool = False
    moe_grouped_gemm: bool = False

    def recipe(self):
        from npuspeed.ops.fp8 import Fp8Recipe

        return Fp8Recipe(self.fp8_recipe, fp8_format=self.fp8, margin=self.fp8_margin,
                         amax_history_len=self.fp8_amax_history_len,
                         amax_compute_algo=self.fp8_amax_compute_algo, wgrad_fp8=not self.no_fp8_wgrad)


#: plan=None: not modelled by the planner yet (issue 50: "npuspeed plan predicts FP8 steps at the
#: device's FP8 peak"): on the CPU, the one backend that runs it, the emulated GEMMs are not faster
class Fp8Feature(Feature, name="fp8", Config=Config, patches=_patches, plan=None, switch="fp8",
                 requires={"fp8_recipe": "fp8", "fp8_margin": "fp8", "fp8_amax_history_len": "fp8",
                           "fp8_amax_compute_algo": "fp8", "no_fp8_wgrad": "fp8", "first_last_layers_bf16": "fp8",
                           "num_layers_at_start_in_bf16": "first_last_layers_bf16",
                           "num_layers_at_end_in_bf16": "first_last_layers_bf16"}):
    def validate(self, ctx) -> None:
        config = self.config(ctx.args)
        self.check_requires(config)
        if not ctx.accelerator.host_is_device():
            raise FeatureError(f"{FLAG}: npuspeed's FP8 GEMMs run on the CPU backend only so far (the CUDA "
                               "torch._scaled_mm and NPU quantized-matmul paths are not wired); drop "
                               f"{FLAG} on this device")
        if getattr(ctx.megatron, "transformer_impl", None) == "transformer_engine":
            raise FeatureError(f"{FLAG} with --transformer-impl transformer_engine: TE runs Megatron's FP8 "
                               "itself; use --transformer-impl local for npuspeed's")
        if config.use_coc:
            raise FeatureError(f"{FLAG} with --use-coc: both replace the tensor-parallel linears' GEMMs; "
                               "drop one")
        if config.moe_grouped_gemm:
            raise FeatureError(f"{FLAG} with --moe-grouped-gemm: an FP8 grouped GEMM is not done yet; drop "
                               "--moe-grouped-gemm (the experts' linears then run in FP8)")
        if config.fp8_recipe == "delayed" and config.first_last_layers_bf16:
            raise FeatureError("--first-last-layers-bf16 with --fp8-recipe delayed: Megatron refuses this "
                               "pair; use --fp8-recipe tensorwise")
        if config.fp8_recipe == "delayed" and getattr(ctx.megatron, "recompute_granularity", None):
            raise FeatureError("--fp8-recipe delayed with --recompute-granularity: a recomputed forward "
                               "would quantize with the scale its first run updated; use --fp8-recipe "
                               "tensorwise")
        for field in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if getattr(config, field) < 0:
                raise FeatureError(f"--{field.replace('_', '-')} {getattr(config, field)}: must be 0 or more")
        try:
            config.recipe()
        except ValueError as err:
            raise FeatureError(str(err)) from None

    def check_built(self, block, ctx) -> str | None:
        from npuspeed.features.fp8.layers import bf16_layer

        config = self.config(ctx.args)
        layers = getattr(block, "layers", None)
        if not layers:
            return None
        num_layers = block.config.num_layers
        if all(bf16_layer(layer.layer_number - 1, num_layers, config) for layer in layers):
            return ("--first-last-layers-bf16 keeps every layer of this block out of FP8, so --fp8-format "
                    "would do nothing; lower --num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16")
        return None

    def running(self, ctx) -> str:
        config = self.config(ctx.args)
        from npuspeed import telemetry

        counts = telemetry.snapshot(_patches.PREFIX)
        return (f"npuspeed's FP8 linear (npuspeed/ops/fp8) in the transformer layers' linears: "
                f"--fp8-recipe {config.fp8_recipe}, --fp8-format {config.fp8}, GEMMs in the exact emulation "
                f"(CPU; slower than the run without the flag); counters: {counts or 'none yet'}")
