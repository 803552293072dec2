"""The four MoE flags, one feature each: validation from the flags, the check of the built
model (a flag never idles silently), the patches, and the report line."""
from __future__ import annotations

from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.moe import grouped_mlp, overlap, permute, tp_extend_ep
from npuspeed.features.moe.layout import Layout, layers_of
from npuspeed.patching.versions import in_range, megatron_version

#: the megatron-core releases whose MoE code each patch is written against
GROUPED_MLP_RANGE = grouped_mlp.MEGATRON_RANGE
OVERLAP_RANGE = overlap.MEGATRON_RANGE
PERMUTE_RANGE = permute.MEGATRON_RANGE


def _needs_release(flag: str, spec: str, why: str) -> None:
    if not in_range(spec):
        raise FeatureError(f"{flag} needs megatron-core {spec} ({why}); this is {megatron_version()}: upgrade "
                           "megatron-core or drop the flag")


def _needs_moe(flag: str, block) -> str | None:
    """A model without experts gives the flag nothing to do (a pipeline stage may still hold
    only dense layers of a MoE model: that is fine)."""
    if not getattr(getattr(block, "config", None), "num_moe_experts", None):
        return f"{flag}: the model has no experts (needs --num-experts with a MoE layer spec)"
    return None


class GroupedGemmFeature(Feature):
    name = "moe_grouped_gemm"
    flags = ("--moe-grouped-gemm",)

    def add_arguments(self, group) -> None:
        group.add_argument("--moe-grouped-gemm", action="store_true",
                           help="Megatron's flag: experts as one grouped matmul per expert weight (GroupedMLP) on "
                                "every backend (torch grouped mm on CPU, npu_grouped_matmul on NPU), fp32/bf16.")

    def enabled(self, args) -> bool:
        return bool(getattr(args, "moe_grouped_gemm", False))

    def validate(self, ctx) -> None:
        _needs_release("--moe-grouped-gemm", GROUPED_MLP_RANGE, "GroupedMLP takes the router probabilities")
        lay = Layout.from_ctx(ctx)
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

    def register_patches(self, registry, ctx) -> None:
        grouped_mlp.register(registry, self.name)

    def check_built(self, block, ctx) -> str | None:
        from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP

        problem = _needs_moe("--moe-grouped-gemm", block)
        if problem:
            return problem
        kinds = {type(layer.experts).__name__ for layer in layers_of(block)}
        if any(isinstance(layer.experts, SequentialMLP) for layer in layers_of(block)) and not any(
                isinstance(layer.experts, GroupedMLP) for layer in layers_of(block)):
            return ("--moe-grouped-gemm: the MoE layers were built with SequentialMLP: build the layer spec with "
                    f"moe_grouped_gemm=True (get_gpt_layer_local_spec); found {sorted(kinds)}")
        return None

    def path(self, ctx) -> str:
        if not self.enabled(ctx.args):
            return "off"
        acc = ctx.accelerator
        if acc.name == "npu":
            kernel = "torch_npu.npu_grouped_matmul (weight gradients per expert)"
        else:
            import torch

            from npuspeed.features.moe.grouped_gemm import torch_grouped_mm_runs

            usable = torch_grouped_mm_runs(acc.device(), torch.float32) if acc.name == "cpu" else None
            kernel = ("torch._grouped_mm (torch grouped mm) where the device/dtype runs it, else one mm per expert"
                      if usable is not False else "one mm per expert into one output (no torch grouped mm here)")
        from npuspeed.ops.moe_swiglu import OP
        from npuspeed.ops._dispatch import describe

        return (f"Megatron's GroupedMLP with {kernel}; SwiGLU x router prob: {describe(OP) if acc.name == 'cpu' else acc.name}"
                f"; GroupedMLPs built: {ctx.counters.get('moe.grouped_mlp.built')}")


class FusedPermuteFeature(Feature):
    name = "moe_fused_permute"
    flags = ("--use-fused-moe-token-permute-and-unpermute",)

    def add_arguments(self, group) -> None:
        group.add_argument("--use-fused-moe-token-permute-and-unpermute", action="store_true",
                           help="MindSpeed's flag: MoE token permute/unpermute as one op each way (CPU: npuspeed:: "
                                "C++; NPU: torch_npu npu_moe_token_(un)permute_with_routing_map).")

    def enabled(self, args) -> bool:
        return bool(getattr(args, "use_fused_moe_token_permute_and_unpermute", False))

    def validate(self, ctx) -> None:
        _needs_release("--use-fused-moe-token-permute-and-unpermute", PERMUTE_RANGE,
                       "permute returns the permuted probabilities")
        if Layout.from_ctx(ctx).dispatcher == "flex":
            raise FeatureError("--use-fused-moe-token-permute-and-unpermute: the flex dispatcher permutes inside "
                               "DeepEP/HybridEP; use --moe-token-dispatcher-type alltoall or allgather")

    def prepare(self, ctx) -> None:
        m = ctx.megatron
        dropping = getattr(m, "moe_expert_capacity_factor", None) and not getattr(m, "moe_pad_expert_input_to_capacity", None)
        if ctx.accelerator.name == "npu" and dropping:
            ctx.note("--use-fused-moe-token-permute-and-unpermute: torch_npu's permute needs the same number of "
                     "experts per token; with a capacity factor and no --moe-pad-expert-input-to-capacity, "
                     "dropped tokens make that false (add the padding flag)")
        if "reference" in self.path(ctx):
            ctx.note(f"--use-fused-moe-token-permute-and-unpermute: {self.path(ctx)}")

    def register_patches(self, registry, ctx) -> None:
        permute.register(registry, self.name)

    def check_built(self, block, ctx) -> str | None:
        return _needs_moe("--use-fused-moe-token-permute-and-unpermute", block)

    def path(self, ctx) -> str:
        if not self.enabled(ctx.args):
            return "off"
        acc = ctx.accelerator
        if acc.name == "npu":
            return "torch_npu npu_moe_token_permute_with_routing_map / npu_moe_token_unpermute_with_routing_map"
        from npuspeed.ops._extension import has_op, load_library

        if acc.name == "cpu" and has_op("moe_permute"):
            return f"npuspeed::moe_permute / moe_unpermute (C++ csrc/cpu/moe_permute.cpp, {load_library()['source']})"
        return "pure-PyTorch reference (Megatron's unfused algorithm; no npuspeed kernel for this device)"


class AllToAllOverlapFeature(Feature):
    name = "moe_alltoall_overlap"
    flags = ("--moe-alltoall-overlap-comm", "--moe-alltoall-chunks")

    def add_arguments(self, group) -> None:
        group.add_argument("--moe-alltoall-overlap-comm", action="store_true",
                           help="All-to-all dispatcher: dispatch and combine in chunks overlapped with the experts' "
                                "compute, shared experts computed while the first chunk is in flight.")
        group.add_argument("--moe-alltoall-chunks", type=int, default=None,
                           help="With --moe-alltoall-overlap-comm: chunks per MoE layer (>= 2, default 2).")

    def enabled(self, args) -> bool:
        return bool(getattr(args, "moe_alltoall_overlap_comm", False) or getattr(args, "moe_alltoall_chunks", None))

    def chunks(self, ctx) -> int:
        return ctx.args.moe_alltoall_chunks or 2

    def validate(self, ctx) -> None:
        if not ctx.args.moe_alltoall_overlap_comm:
            raise FeatureError("--moe-alltoall-chunks only applies with --moe-alltoall-overlap-comm: add it or drop "
                               "--moe-alltoall-chunks")
        _needs_release("--moe-alltoall-overlap-comm", OVERLAP_RANGE, "MoELayer's route/preprocess/dispatch steps")
        if self.chunks(ctx) < 2:
            raise FeatureError(f"--moe-alltoall-chunks must be >= 2 (got {ctx.args.moe_alltoall_chunks}): one chunk "
                               "leaves the all-to-all nothing to overlap with")
        lay = Layout.from_ctx(ctx)
        if lay.dispatcher is not None and lay.dispatcher != "alltoall":
            raise FeatureError(f"--moe-alltoall-overlap-comm overlaps the all-to-all dispatcher; "
                               f"--moe-token-dispatcher-type is {lay.dispatcher}: use alltoall or drop the flag")
        if lay.expert_parallel == 1 and (ctx.megatron.expert_model_parallel_size is not None or lay.tp_extend_ep):
            raise FeatureError("--moe-alltoall-overlap-comm: expert-parallel size is 1, so there is no all-to-all to "
                               "overlap; use --expert-model-parallel-size > 1 (or --moe-tp-extend-ep with TP > 1)")
        if lay.expert_tp > 1:
            raise FeatureError(f"--moe-alltoall-overlap-comm chunks whole token rows, but experts are split over "
                               f"{lay.expert_tp} tensor-parallel ranks; add --moe-tp-extend-ep or "
                               "--expert-tensor-parallel-size 1")
        if getattr(ctx.megatron, "moe_shared_expert_overlap", None):
            raise FeatureError("--moe-alltoall-overlap-comm computes the shared experts during the all-to-all itself; "
                               "drop Megatron's --moe-shared-expert-overlap")

    def register_patches(self, registry, ctx) -> None:
        overlap.register(registry, self.name, self.chunks(ctx), ctx.note)

    def check_built(self, block, ctx) -> str | None:
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        problem = _needs_moe("--moe-alltoall-overlap-comm", block)
        if problem:
            return problem
        kinds = {type(layer.token_dispatcher).__name__ for layer in layers_of(block)}
        if kinds and not any(isinstance(layer.token_dispatcher, MoEAlltoAllTokenDispatcher) for layer in layers_of(block)):
            return f"--moe-alltoall-overlap-comm needs --moe-token-dispatcher-type alltoall (built: {sorted(kinds)})"
        return None

    def path(self, ctx) -> str:
        if not self.enabled(ctx.args):
            return "off"
        acc = ctx.accelerator
        where = ("async work handles on gloo, waited per chunk" if acc.name == "cpu"
                 else f"async {acc.dist_backend} collectives on the backend's communication stream")
        return (f"MoELayer.forward: dispatch/experts/combine in {self.chunks(ctx)} chunks, {where}; shared experts "
                "during the first chunk's all-to-all")


class TpExtendEpFeature(Feature):
    name = "moe_tp_extend_ep"
    flags = ("--moe-tp-extend-ep",)

    def add_arguments(self, group) -> None:
        group.add_argument("--moe-tp-extend-ep", action="store_true",
                           help="MindSpeed's flag: the tensor-parallel ranks serve as extra expert-parallel ranks "
                                "(experts over EP x TP ranks, expert weights not split by TP).")

    def enabled(self, args) -> bool:
        return bool(getattr(args, "moe_tp_extend_ep", False))

    def validate(self, ctx) -> None:
        lay = Layout.from_ctx(ctx)
        if lay.tp == 1:
            raise FeatureError("--moe-tp-extend-ep extends expert parallelism over the tensor-parallel ranks, but "
                               "--tensor-model-parallel-size is 1 (or not given): use TP > 1 or drop the flag")
        if lay.etp not in (None, 1):
            raise FeatureError(f"--moe-tp-extend-ep keeps each expert whole on a rank, but --expert-tensor-parallel-size "
                               f"is {lay.etp}: drop one of the two")
        if lay.experts is not None and lay.experts % (lay.ep * lay.tp):
            raise FeatureError(f"--moe-tp-extend-ep spreads the experts over EP x TP = {lay.ep} x {lay.tp} = "
                               f"{lay.ep * lay.tp} ranks, which does not divide --num-experts {lay.experts}; choose "
                               "a multiple of it or drop the flag")

    def register_patches(self, registry, ctx) -> None:
        tp_extend_ep.register(registry, self.name)

    def check_built(self, block, ctx) -> str | None:
        return _needs_moe("--moe-tp-extend-ep", block)

    def path(self, ctx) -> str:
        if not self.enabled(ctx.args):
            return "off"
        lay = Layout.from_ctx(ctx)
        return (f"experts over EP x TP = {lay.ep} x {lay.tp} ranks, expert-TP 1 (megatron.core expert layout "
                "set at initialize_model_parallel and on every TransformerConfig)")


FEATURES = (GroupedGemmFeature, FusedPermuteFeature, AllToAllOverlapFeature, TpExtendEpFeature)
