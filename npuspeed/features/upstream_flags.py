"""Megatron's own features (0.14-0.19) that do what an npuspeed flag does: refused as a pair.

Read from Megatron's flags as given (`ctx.megatron`), so a release that lacks one of them
simply never sees it. Each pair below was read in Megatron-LM core_v0.17.0-core_v0.19.0;
each is refused rather than composed because both sides own the same tensors or the same
code path, and running both would do the work twice or undo each other:

- `--recompute-modules layernorm` (selective) checkpoints the input/pre-MLP norms, as
  `--recompute-norm` does: two checkpoints of one output. `moe_act` checkpoints the experts'
  activation (grouped GEMM), which `--recompute-activation-function` frees in MLP.forward.
- `--overlap-moe-expert-parallel-comm` hides the EP all-to-all behind another micro-batch (with
  npuspeed: --moe-fb-overlap's schedule, features/moe_fb_overlap/takeover.py);
  `--moe-alltoall-overlap-comm` chunks the same all-to-all inside one.
- `--fine-grained-activation-offloading` moves module inputs to the host, as `--swap-attention`.
- an emerging optimizer (`--optimizer muon|dist_muon|lion|soap|adaptive_muon`) builds the
  layer-wise distributed optimizer, whose buffers are not the masters and states that
  `--swap-optimizer` moves and `--reuse-fp32-param` shares.
- `--pipeline-model-parallel-layout` places layers per stage unevenly; the adaptive policy
  plans layers per stage from --num-layers / PP and would plan stages that do not exist.
- CUDA graphs replay captured kernels: npuspeed's patched forward paths decide per call on
  the host (per-shape choice, counters, swaps), which a replay would freeze or skip.
- GTP weight rematerialisation (`--tensor-parallel-num-weight-shards` above TP) re-shards the
  TP linear weights (Transformer Engine layers) and their optimizer state: `--use-coc`
  rewrites the same layers' communication, and `--reuse-fp32-param` the masters' layout.
"""
from __future__ import annotations

from npuspeed.features.base import FeatureError

_EMERGING = ("muon", "dist_muon", "lion", "soap", "adaptive_muon")
_CUDA_GRAPH_FEATURES = ("fused_attention", "fused_rmsnorm", "fused_swiglu", "fused_rotary_pos_emb", "fused_linear_ce",
                        "recompute_activation", "recompute_norm", "swap_attention", "coc_overlap", "moe_grouped_gemm",
                        "moe_fused_permute", "moe_alltoall_overlap", "moe_fb_overlap", "context_parallel")


def _selective(m, module: str) -> bool:
    return getattr(m, "recompute_granularity", None) == "selective" and module in (m.recompute_modules or ())


def _cuda_graph(m) -> str | None:
    if m.enable_cuda_graph:
        return "--enable-cuda-graph"
    if m.external_cuda_graph:
        return "--external-cuda-graph"
    if m.cuda_graph_impl not in (None, "none"):
        return f"--cuda-graph-impl {m.cuda_graph_impl}"
    return None


def _gtp(m) -> str | None:
    tp = m.tensor_model_parallel_size or 1
    if m.tensor_parallel_num_weight_shards and m.tensor_parallel_num_weight_shards > tp:
        return f"--tensor-parallel-num-weight-shards {m.tensor_parallel_num_weight_shards}"
    if m.expert_tensor_parallel_num_weight_shards and m.expert_tensor_parallel_num_weight_shards > (
            m.expert_tensor_parallel_size or tp):
        return f"--expert-tensor-parallel-num-weight-shards {m.expert_tensor_parallel_num_weight_shards}"
    return None


def _theirs(feature: str, m) -> tuple[str, str, str] | None:
    """(Megatron's flag as given, npuspeed's flag, why) for the first pair `feature` is in."""
    if feature == "recompute_norm" and _selective(m, "layernorm"):
        return "--recompute-modules layernorm", "--recompute-norm", "both recompute the norms' outputs"
    if feature == "recompute_activation" and _selective(m, "moe_act"):
        return ("--recompute-modules moe_act", "--recompute-activation-function",
                "both recompute the MLP activation (the experts' too)")
    if feature == "moe_alltoall_overlap" and m.overlap_moe_expert_parallel_comm:
        return ("--overlap-moe-expert-parallel-comm", "--moe-alltoall-overlap-comm",
                "both overlap the expert-parallel all-to-all, each with its own schedule")
    if feature == "swap_attention" and m.fine_grained_activation_offloading:
        return ("--fine-grained-activation-offloading", "--swap-attention",
                "both move saved activations to host memory")
    for npus, name in (("--swap-optimizer", "swap_optimizer"), ("--reuse-fp32-param", "reuse_fp32_param")):
        if feature == name and m.optimizer in _EMERGING:
            return (f"--optimizer {m.optimizer}", npus, "Megatron then builds its layer-wise distributed optimizer, "
                    "whose buffers are not the masters and states this flag handles")
    if feature == "adaptive_memory" and m.pipeline_model_parallel_layout:
        return ("--pipeline-model-parallel-layout", "--adaptive-recompute-device-size",
                "the policy plans --num-layers / PP layers per stage, not an explicit layout")
    graph = _cuda_graph(m)
    if graph and feature in _CUDA_GRAPH_FEATURES:
        return graph, "", "a captured graph replays kernels and skips npuspeed's patched forward paths"
    gtp = _gtp(m)
    if gtp and feature in ("coc_overlap", "reuse_fp32_param"):
        flag = "--use-coc" if feature == "coc_overlap" else "--reuse-fp32-param"
        return gtp, flag, "GTP re-shards the tensor-parallel weights and their masters itself"
    return None


def refuse(features, ctx) -> None:
    """Raise FeatureError for the first enabled npuspeed feature paired with Megatron's own."""
    for feature in features:
        pair = _theirs(feature.name, ctx.megatron)
        if pair is None:
            continue
        theirs, ours, why = pair
        ours = ours or next((f for f in feature.flags if f in ctx.argv), feature.flags[0])
        raise FeatureError(f"{ours} with Megatron's {theirs}: {why}; pick one (drop {theirs} or {ours})")
