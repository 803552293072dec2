"""The torch_npu ops npuspeed calls, each with the flags whose path reaches it.

`npuspeed report` says per op whether this torch_npu has it, so a release that lacks one is
seen before a run falls back (or fails) on it; tests/unit/test_report_torch_npu.py keeps the
list whole: every `<x>.npu_*(...)` call in npuspeed's source must be listed here.
"""
from __future__ import annotations

# the MoE pair is named by the ops layer (below this one), which calls them
from npuspeed.ops.moe_permute import NPU_PERMUTE as MOE_PERMUTE, NPU_UNPERMUTE as MOE_UNPERMUTE

FUSION_ATTENTION = "npu_fusion_attention"
FUSION_ATTENTION_GRAD = "npu_fusion_attention_grad"
RMS_NORM = "npu_rms_norm"
SWIGLU = "npu_swiglu"
ROTARY_MUL = "npu_rotary_mul"
GROUPED_MATMUL = "npu_grouped_matmul"
ALL_GATHER_MM = "npu_all_gather_base_mm"
MM_REDUCE_SCATTER = "npu_mm_reduce_scatter_base"
MM_ALL_REDUCE = "npu_mm_all_reduce_base"
#: the ATB kernel; torch_npu exposes a lazy wrapper by this name even without the ATB/NNAL
#: package, so its presence is the accelerator's answer (has_matmul_add_fp32), not hasattr
MATMUL_ADD_FP32 = "_npu_matmul_add_fp32"

#: op -> the flags whose path calls it
USED_BY = {
    FUSION_ATTENTION: "--use-flash-attn, --context-parallel-size",
    FUSION_ATTENTION_GRAD: "--context-parallel-size",
    RMS_NORM: "--use-fused-rmsnorm",
    SWIGLU: "--use-fused-swiglu, --moe-grouped-gemm",
    ROTARY_MUL: "--use-fused-rotary-pos-emb",
    GROUPED_MATMUL: "--moe-grouped-gemm",
    MOE_PERMUTE: "--use-fused-moe-token-permute-and-unpermute",
    MOE_UNPERMUTE: "--use-fused-moe-token-permute-and-unpermute",
    ALL_GATHER_MM: "--use-ascend-mc2",
    MM_REDUCE_SCATTER: "--use-ascend-mc2",
    MM_ALL_REDUCE: "--use-ascend-mc2",
    MATMUL_ADD_FP32: "--gradient-accumulation-fusion",
}


def _found(accelerator, op: str) -> bool:
    if op == MATMUL_ADD_FP32 and callable(getattr(accelerator, "has_matmul_add_fp32", None)):
        return bool(accelerator.has_matmul_add_fp32())
    return hasattr(accelerator.torch_npu, op)


def availability(accelerator) -> dict | None:
    """None off an NPU; else torch_npu's release and, per op, whether it has it and who uses it."""
    if accelerator.name != "npu":
        return None
    torch_npu = accelerator.torch_npu
    version = getattr(torch_npu, "__version__", None)
    return {
        "version": None if version is None else str(version),
        "ops": {op: {"found": _found(accelerator, op), "used_by": flags} for op, flags in USED_BY.items()},
    }


#: the oldest torch_npu whose op contract npuspeed is checked against (tests/contract/); 2.4.x's
#: npu_grouped_matmul takes another form (int[] group_list, a weight per group, no group_type)
OLDEST = (2, 6)


def release_problem(torch_npu) -> str | None:
    """Why this torch_npu is too old for npuspeed's NPU paths (None: it is not)."""
    version = str(getattr(torch_npu, "__version__", ""))
    parts = version.split("+")[0].split(".")
    try:
        found = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return None  # a build without a release number: nothing to compare
    if found >= OLDEST:
        return None
    oldest = ".".join(map(str, OLDEST))
    return (f"npuspeed's NPU backend needs torch_npu >= {oldest}.0 (its op contract is checked from "
            f"{oldest}.0 on); this is torch_npu {version}. Install torch_npu>={oldest}.0 with the torch "
            "release it names, or set NPUSPEED_DEVICE=cpu.")

