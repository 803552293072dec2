"""The Ascend NPU backend, through torch_npu (imported here only, and only when chosen).

`torch.npu` mirrors `torch.cuda`, so the CUDA face is reused over it; what differs is the
collective library (HCCL) and the fused kernels torch_npu adds.
"""
from __future__ import annotations

import importlib

import torch

from npuspeed.accelerator import npu_ops
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

    def kernel(self, name: str):
        """torch_npu's op `name` (npu_fusion_attention, npu_swiglu, ...), or None where this
        release has none."""
        return getattr(self.torch_npu, name, None)

    def has_fused_attention(self) -> bool:
        return self.kernel(npu_ops.FUSION_ATTENTION) is not None

    def has_mc2(self) -> bool:
        return all(self.kernel(op) is not None for op in (npu_ops.ALL_GATHER_MM, npu_ops.MM_REDUCE_SCATTER))

    #: torch_npu's fused matmul-accumulate: op-plugin's ATB kernel, `_npu_matmul_add_fp32` in
    #: every torch_npu wheel 2.6.0-2.14.0 (no build names it without the underscore)
    _MATMUL_ADD = npu_ops.MATMUL_ADD_FP32
    #: (the op or None, why it is absent or None) after the first probe
    _matmul_add_probe: tuple | None = None

    def _matmul_add(self):
        if self._matmul_add_probe is None:
            self._matmul_add_probe = self._probe_matmul_add()
        return self._matmul_add_probe[0]

    def _probe_matmul_add(self) -> tuple:
        """torch_npu sets the ATB ops as lazy wrappers (op_plugin/atb/_atb_ops.py) that load
        libop_plugin_atb.so on their first call: the name exists even where the NNAL package
        (libatb.so) is missing, and then the first call raises OSError. One tiny call, once,
        tells whether the kernel runs."""
        op = self.kernel(self._MATMUL_ADD)
        if op is None:
            return None, None
        try:
            device = self.device()
            x = torch.zeros(16, 16, dtype=torch.bfloat16, device=device)
            op(x, x, torch.zeros(16, 16, dtype=torch.float32, device=device))
            self.synchronize()
        except (OSError, RuntimeError) as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            return None, (f"torch_npu.{self._MATMUL_ADD} failed its first call ({type(exc).__name__}: "
                          f"{first}): the NNAL/ATB package it loads is missing or does not match torch_npu")
        return op, None

    def has_matmul_add_fp32(self) -> bool:
        return self._matmul_add() is not None

    def matmul_add_fp32_missing(self) -> str | None:
        """Why torch_npu names the kernel but it does not run here (None: it runs, or torch_npu
        does not name it)."""
        self._matmul_add()
        return self._matmul_add_probe[1]

    def matmul_add_fp32(self, grad_output, total_input, main_grad) -> None:
        # torch_npu._npu_matmul_add_fp32(x, weight, C): C += x^T @ weight, x and weight
        # float16/bfloat16 [rows, n] / [rows, k], C float32 [n, k], updated in place.
        self._matmul_add()(grad_output, total_input, main_grad)

    def transfer_to_npu(self) -> None:
        """Let torch_npu map `torch.cuda` and `device='cuda'` onto the NPU."""
        importlib.import_module("torch_npu.contrib.transfer_to_npu")
