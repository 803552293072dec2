"""--moe-grouped-gemm as a feature: refuses expert layouts the grouped MLP cannot hold, and
a model that built SequentialMLP experts anyway; reports which grouped matmul runs (the grouped
matmul: grouped_gemm.py; the experts: grouped_mlp.py, grouped_experts.py; patches.py, plan.py)."""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.moe_grouped_gemm import patches as _patches, plan as _plan
from npuspeed.features.moe_common.layout import Layout, layers_of, needs_experts, needs_release
from npuspeed.features.moe_grouped_gemm import grouped_mlp
from npuspeed.patching.versions import in_range


RANGE = ">=0.13,<0.20"


def _grouped(experts) -> bool:
    """GroupedMLP (0.13-0.16) or npuspeed's grouped experts (0.17+)."""
    return hasattr(experts, "weight1") or getattr(experts, "npuspeed_grouped", False)


@dataclass(frozen=True)
class Config(FeatureConfig):
    moe_grouped_gemm: bool = flag("--moe-grouped-gemm", False)
    """Megatron's flag: experts as one grouped matmul per expert weight (GroupedMLP) on every
    backend (torch grouped mm on CPU, npu_grouped_matmul on NPU), fp32/bf16."""
    # moe_tp_extend_ep's flag (it owns it: no --help here): the expert layout it changes
    moe_tp_extend_ep: bool = False


class MoeGroupedGemmFeature(Feature, name="moe_grouped_gemm", Config=Config, patches=_patches, plan=_plan,
                            switch="moe_grouped_gemm"):
    def validate(self, ctx) -> None:
        needs_release("--moe-grouped-gemm", RANGE, "GroupedMLP takes the router probabilities (0.13-0.16); "
                      "npuspeed's grouped experts replace the local spec's SequentialMLP (0.17-0.19)")
        lay = Layout.from_ctx(ctx, self.config(ctx.args).moe_tp_extend_ep)
        if lay.experts is not None and not lay.bias_disabled:
            raise FeatureError("--moe-grouped-gemm: the grouped expert MLP has no bias; add --disable-bias-linear "
                               "(or drop --moe-grouped-gemm to keep Megatron's SequentialMLP with biases)")
        if lay.experts is not None and lay.experts % lay.expert_parallel:
            raise FeatureError(f"--moe-grouped-gemm: {lay.experts} experts cannot be split over {lay.expert_parallel} "
                               "expert-parallel ranks; choose --num-experts divisible by --expert-model-parallel-size"
                               + (" x --tensor-model-parallel-size" if lay.tp_extend_ep else ""))
        if lay.ffn is not None and lay.ffn % lay.expert_tp:
            raise FeatureError(f"--moe-grouped-gemm: the expert FFN size {lay.ffn} cannot be split over "
                               f"{lay.expert_tp} expert tensor-parallel ranks; choose --moe-ffn-hidden-size divisible "
                               "by it, --expert-tensor-parallel-size 1, or --moe-tp-extend-ep")

    def check_built(self, block, ctx) -> str | None:
        from megatron.core.transformer.moe.experts import SequentialMLP

        problem = needs_experts("--moe-grouped-gemm", block)
        if problem:
            return problem
        kinds = {type(layer.experts).__name__ for layer in layers_of(block)}
        grouped = [_grouped(layer.experts) for layer in layers_of(block)]
        if any(isinstance(layer.experts, SequentialMLP) and not g for layer, g in zip(layers_of(block), grouped)) \
                and not any(grouped):
            return ("--moe-grouped-gemm: the MoE layers were built with SequentialMLP: build the layer spec with "
                    f"moe_grouped_gemm=True (get_gpt_layer_local_spec); found {sorted(kinds)}")
        return None

    def running(self, ctx) -> str:
        acc = ctx.accelerator
        traits = for_device(acc.name)
        if traits.has_vendor_kernels():
            kernel = "torch_npu.npu_grouped_matmul (weight gradients per expert)"
        else:
            import torch

            from npuspeed.features.moe_grouped_gemm.grouped_gemm import torch_grouped_mm_runs

            usable = torch_grouped_mm_runs(acc.device(), torch.float32) if traits.host_is_device() else None
            kernel = ("torch._grouped_mm (torch grouped mm) where the device/dtype runs it, else one mm per expert"
                      if usable is not False else "one mm per expert into one output (no torch grouped mm here)")
        from npuspeed.ops.moe_swiglu import OP
        from npuspeed.ops._dispatch import describe

        from npuspeed.features.chooser_setup import choice_lines

        module = ("Megatron's GroupedMLP" if in_range(grouped_mlp.MEGATRON_RANGE) else
                  "npuspeed's GroupedSequentialMLP (SequentialMLP's parameters and checkpoint layout)")
        return (f"{module} with {kernel}; the grouped kernel only where it beats one mm per expert "
                f"(Megatron's SequentialMLP matmuls, `megatron` below), measured once per shape fwd+bwd; "
                f"SwiGLU x router prob: {describe(OP) if traits.host_is_device() else acc.name}"
                f"; GroupedMLPs built: {ctx.counters.get('moe.grouped_mlp.built')}{choice_lines('grouped_mm')}")
