"""--use-fused-moe-token-permute-and-unpermute as a feature: which permute ops run, and the
dispatchers and accelerators they cannot serve."""
from __future__ import annotations

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.moe import permute
from npuspeed.features.moe.layout import Layout, needs_experts, needs_release
from npuspeed.ops import npu


class FusedPermuteFeature(Feature):
    name = "moe_fused_permute"
    flags = ("--use-fused-moe-token-permute-and-unpermute",)

    def add_arguments(self, group) -> None:
        group.add_argument("--use-fused-moe-token-permute-and-unpermute", action="store_true",
                           help="MindSpeed's flag: MoE token permute/unpermute as one op each way (CPU: npuspeed:: "
                                "C++; CUDA: npuspeed's Triton kernels; NPU: torch_npu "
                                "npu_moe_token_(un)permute_with_routing_map, else Triton), where measured "
                                "faster than Megatron's pair (once per shape).")

    def enabled(self, args) -> bool:
        return bool(getattr(args, "use_fused_moe_token_permute_and_unpermute", False))

    def validate(self, ctx) -> None:
        needs_release("--use-fused-moe-token-permute-and-unpermute", permute.MEGATRON_RANGE,
                       "permute returns the permuted probabilities")
        if Layout.from_ctx(ctx).dispatcher == "flex":
            raise FeatureError("--use-fused-moe-token-permute-and-unpermute: the flex dispatcher permutes inside "
                               "DeepEP/HybridEP; use --moe-token-dispatcher-type alltoall or allgather")

    def prepare(self, ctx) -> None:
        m = ctx.megatron
        dropping = getattr(m, "moe_expert_capacity_factor", None) and not getattr(m, "moe_pad_expert_input_to_capacity", None)
        if for_device(ctx.accelerator.name).has_vendor_kernels() and dropping:
            ctx.note("--use-fused-moe-token-permute-and-unpermute: torch_npu's permute needs the same number of "
                     "experts per token; with a capacity factor and no --moe-pad-expert-input-to-capacity, "
                     "dropped tokens make that false (add the padding flag)")
        if "no npuspeed kernel" in self.path(ctx):
            ctx.note(f"--use-fused-moe-token-permute-and-unpermute: {self.path(ctx)}")

    def register_patches(self, registry, ctx) -> None:
        from npuspeed.features.chooser_setup import configure

        configure(ctx)
        permute.register(registry, self.name)

    def check_built(self, block, ctx) -> str | None:
        return needs_experts("--use-fused-moe-token-permute-and-unpermute", block)

    def plan_effect(self, model, ctx):
        """The fused ops keep the tensors Megatron's unfused permute keeps (the rows and the sorted
        index), so memory is the same; time is in the calibrated layer (the worker runs them)."""
        from npuspeed.features.base import PlanEffect

        if not model.model.num_experts:
            return None
        return PlanEffect(summary="token permute/unpermute as one op each way: same saved tensors (rows, sorted "
                                  "index), fewer passes over them")

    def path(self, ctx) -> str:
        if not self.enabled(ctx.args):
            return "off"
        from npuspeed.features.chooser_setup import choice_lines

        acc = ctx.accelerator
        rule = ("; Megatron's own permute/unpermute where that measured faster (once per shape, fwd+bwd round trip)"
                + choice_lines("moe_permute"))
        triton = _triton_state()
        traits = for_device(acc.name)
        if traits.has_vendor_kernels():
            from npuspeed.ops.moe_permute import NPU_PERMUTE

            if npu.has(acc, NPU_PERMUTE):
                return ("torch_npu npu_moe_token_permute_with_routing_map / npu_moe_token_unpermute_with_routing_map"
                        + rule)
            if triton:
                return f"{triton} (this torch_npu has no {NPU_PERMUTE})" + rule
            return f"Megatron's own permute/unpermute (no npuspeed kernel: this torch_npu has no {NPU_PERMUTE}, " \
                   "and no Triton)"
        if not traits.host_is_device():
            if triton:
                return triton + rule
            return "Megatron's own permute/unpermute (no npuspeed kernel for this device: triton does not run here)"
        from npuspeed.ops._extension import has_op, load_library

        if has_op("moe_permute"):
            return (f"npuspeed::moe_permute / moe_unpermute (C++ csrc/cpu/moe_permute.cpp, "
                    f"{load_library()['source']})" + rule)
        return "Megatron's own permute/unpermute (no npuspeed kernel for this device)"


def _triton_state() -> str:
    """"npuspeed Triton kernels (...)" where they can run here, else ""."""
    try:
        from npuspeed.ops.triton import moe_permute as kernels
    except ImportError:
        return ""
    return ("npuspeed Triton kernels (npuspeed.ops.triton.moe_permute: gather + fp32 row sums, no atomics)"
            if kernels.available() else "")
