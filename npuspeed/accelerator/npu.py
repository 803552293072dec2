"""The Ascend NPU backend, through torch_npu (imported here only, and only when chosen).

`torch.npu` mirrors `torch.cuda`, so the CUDA face is reused over it; what differs is the
collective library (HCCL) and the fused kernels torch_npu adds.
"""
from __future__ import annotations

import importlib

import torch

from npuspeed.accelerator.cuda import CudaAccelerator


def import_torch_npu():
    """Import torch_npu or raise ImportError; never called at module import."""
    return importlib.import_module("torch_npu")


class NpuAccelerator(CudaAccelerator):
    name = "npu"
    dist_backend = "hccl"

    def __init__(self):
        self.torch_npu = import_torch_npu()
        super().__init__(module=torch.npu)

    def is_bf16_supported(self) -> bool:
        return True

    def has_fused_attention(self) -> bool:
        return hasattr(self.torch_npu, "npu_fusion_attention")

    def has_mc2(self) -> bool:
        return hasattr(self.torch_npu, "npu_all_gather_base_mm") and hasattr(
            self.torch_npu, "npu_mm_reduce_scatter_base"
        )

    #: torch_npu's fused matmul-accumulate, by the names builds expose it: op-plugin registers
    #: the ATB kernel as `_npu_matmul_add_fp32` (what vllm-ascend calls); some builds/shims
    #: also expose `npu_matmul_add_fp32`
    _MATMUL_ADD = ("npu_matmul_add_fp32", "_npu_matmul_add_fp32")

    def _matmul_add(self):
        return next((getattr(self.torch_npu, n) for n in self._MATMUL_ADD if hasattr(self.torch_npu, n)), None)

    def has_matmul_add_fp32(self) -> bool:
        return self._matmul_add() is not None

    def matmul_add_fp32(self, grad_output, total_input, main_grad) -> None:
        # torch_npu._npu_matmul_add_fp32(x, weight, C): C += x^T @ weight, x and weight
        # float16/bfloat16 [rows, n] / [rows, k], C float32 [n, k], updated in place.
        self._matmul_add()(grad_output, total_input, main_grad)

    def transfer_to_npu(self) -> None:
        """Let torch_npu map `torch.cuda` and `device='cuda'` onto the NPU."""
        importlib.import_module("torch_npu.contrib.transfer_to_npu")
