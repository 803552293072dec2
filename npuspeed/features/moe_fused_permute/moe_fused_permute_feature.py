"""--use-fused-moe-token-permute-and-unpermute as a feature: which permute ops run, and the
dispatchers and accelerators they cannot serve (the wrappers: permute.py, ops in
npuspeed/ops/moe_permute.py; patches.py; plan.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.moe_fused_permute import patches as _patches, plan as _plan
from npuspeed.features.moe_common.layout import Layout, needs_experts, needs_release
from npuspeed.features.moe_fused_permute import permute
from npuspeed.ops import npu


@dataclass(frozen=True)
class Config(FeatureConfig):
    use_fused_moe_token_permute_and_unpermute: bool = flag("--use-fused-moe-token-permute-and-unpermute", False)
    """MindSpeed's flag: MoE token permute/unpermute as one op each way (CPU: npuspeed:: C++;
    CUDA: npuspeed's Triton kernels; NPU: torch_npu npu_moe_token_(un)permute_with_routing_map,
    else Triton), where measured faster than Megatron's pair (once per shape)."""


class MoeFusedPermuteFeature(Feature, name="moe_fused_permute", Config=Config, patches=_patches, plan=_plan,
                             switch="use_fused_moe_token_permute_and_unpermute"):
    def validate(self, ctx) -> None:
        needs_release("--use-fused-moe-token-permute-and-unpermute", permute.MEGATRON_RANGE,
                       "permute returns the permuted probabilities")
        if Layout.from_ctx(ctx, tp_extend_ep=False).dispatcher == "flex":  # (only the dispatcher is read)
            raise FeatureError("--use-fused-moe-token-permute-and-unpermute: the flex dispatcher permutes inside "
                               "DeepEP/HybridEP; use --moe-token-dispatcher-type alltoall or allgather")

    def prepare(self, ctx) -> None:
        m = ctx.megatron
        dropping = getattr(m, "moe_expert_capacity_factor", None) and not getattr(m, "moe_pad_expert_input_to_capacity", None)
        if for_device(ctx.accelerator.name).has_vendor_kernels() and dropping:
            ctx.note("--use-fused-moe-token-permute-and-unpermute: torch_npu's permute needs the same number of "
                     "experts per token; with a capacity factor and no --moe-pad-expert-input-to-capacity, "
                     "dropped tokens make that false (add the padding flag)")
        kernel = permute_kernel(ctx.accelerator)
        if not kernel.runs:
            ctx.note(f"--use-fused-moe-token-permute-and-unpermute: {kernel.words}")

    def check_built(self, block, ctx) -> str | None:
        return needs_experts("--use-fused-moe-token-permute-and-unpermute", block)

    def running(self, ctx) -> str:
        from npuspeed.features.chooser_setup import choice_lines

        kernel = permute_kernel(ctx.accelerator)
        if not kernel.runs:
            return kernel.words
        return (kernel.words + "; Megatron's own permute/unpermute where that measured faster (once per shape, "
                "fwd+bwd round trip)" + choice_lines("moe_permute"))


class Kernel(NamedTuple):
    """The permute kernel this accelerator offers the flag: whether one runs (else Megatron's own
    permute does, and `prepare` says so once), and the report's words for it."""
    runs: bool
    words: str


def permute_kernel(acc) -> Kernel:
    """torch_npu's kernel on an NPU that has it, else npuspeed's Triton kernels where triton runs,
    else (on the host) npuspeed's C++ op; Kernel(False, why) where none of them does."""
    triton = _triton_state()
    traits = for_device(acc.name)
    if traits.has_vendor_kernels():
        from npuspeed.ops.moe_permute import NPU_PERMUTE

        if npu.has(acc, NPU_PERMUTE):
            return Kernel(True, "torch_npu npu_moe_token_permute_with_routing_map / "
                                "npu_moe_token_unpermute_with_routing_map")
        if triton:
            return Kernel(True, f"{triton} (this torch_npu has no {NPU_PERMUTE})")
        return Kernel(False, f"Megatron's own permute/unpermute (no npuspeed kernel: this torch_npu has no "
                             f"{NPU_PERMUTE}, and no Triton)")
    if not traits.host_is_device():
        if triton:
            return Kernel(True, triton)
        return Kernel(False, "Megatron's own permute/unpermute (no npuspeed kernel for this device: triton does "
                             "not run here)")
    from npuspeed.ops._extension import has_op, load_library

    if has_op("moe_permute"):
        return Kernel(True, f"npuspeed::moe_permute / moe_unpermute (C++ csrc/cpu/moe_permute.cpp, "
                            f"{load_library()['source']})")
    return Kernel(False, "Megatron's own permute/unpermute (no npuspeed kernel for this device)")


def _triton_state() -> str:
    """"npuspeed Triton kernels (...)" where they can run here, else ""."""
    try:
        from npuspeed.ops.triton import moe_permute as kernels
    except ImportError:
        return ""
    return ("npuspeed Triton kernels (npuspeed.ops.triton.moe_permute: gather + fp32 row sums, no atomics)"
            if kernels.available() else "")
