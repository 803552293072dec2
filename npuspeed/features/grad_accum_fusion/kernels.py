"""The ways to compute `main_grad += dY^T X` (a linear layer's weight gradient), one per name.

`dY` is [rows, n] (the output gradient), `X` is [rows, k] (the layer input, all-gathered
under sequence parallelism), `main_grad` is [n, k], fp32 or the model's 16-bit dtype.
Fused paths never hold an [n, k] product besides main_grad; `mm_add` is the unfused
arithmetic (a GEMM in the input dtype, then an add), kept as a candidate because on some
machines it is faster (a 16-bit GEMM against an fp32 one) and the rule is "never slower".
"""
from __future__ import annotations

import torch

from npuspeed.accelerator.devices import for_device

#: GEMM accumulating in place in main_grad's dtype (fp32 inputs, or 16-bit inputs and grads)
ADDMM = "addmm_inplace"
#: 16-bit inputs upcast to fp32, then ADDMM (CPU; any device without a mixed-dtype GEMM)
ADDMM_UPCAST = "addmm_inplace_upcast"
#: torch's mixed-dtype GEMM: 16-bit inputs, fp32 output written in place (CUDA)
OUT_DTYPE = "addmm_out_dtype_fp32"
#: the device's own fused kernel (torch_npu._npu_matmul_add_fp32, through the accelerator)
NATIVE = "_npu_matmul_add_fp32"
#: the unfused arithmetic: GEMM in the input dtype into a temporary, then main_grad.add_
MM_ADD = "mm_then_add"

#: paths that do not hold an [n, k] temporary
FUSED = (ADDMM, ADDMM_UPCAST, OUT_DTYPE, NATIVE)


def addmm_inplace(g, x, main_grad, accelerator=None):
    main_grad.addmm_(g.t(), x)


def addmm_inplace_upcast(g, x, main_grad, accelerator=None):
    main_grad.addmm_(g.t().to(main_grad.dtype), x.to(main_grad.dtype))


def addmm_out_dtype(g, x, main_grad, accelerator=None):
    torch.addmm(main_grad, g.t(), x, out_dtype=main_grad.dtype, out=main_grad)


def native(g, x, main_grad, accelerator=None):
    accelerator.matmul_add_fp32(g, x, main_grad)


def mm_then_add(g, x, main_grad, accelerator=None):
    main_grad.add_(g.t().matmul(x))


RUN = {ADDMM: addmm_inplace, ADDMM_UPCAST: addmm_inplace_upcast, OUT_DTYPE: addmm_out_dtype,
       NATIVE: native, MM_ADD: mm_then_add}


def candidates(device_type: str, in_dtype: torch.dtype, grad_dtype: torch.dtype, accelerator) -> tuple[str, ...]:
    """The correct paths for these dtypes on this device, preferred first."""
    if in_dtype == grad_dtype:
        return (ADDMM, MM_ADD)
    traits = for_device(device_type)
    if traits.has_vendor_kernels() and accelerator is not None and accelerator.has_matmul_add_fp32() \
            and grad_dtype == torch.float32 and in_dtype in (torch.float16, torch.bfloat16):
        return (NATIVE, MM_ADD)
    if traits.has_out_dtype_matmul() and grad_dtype == torch.float32 and in_dtype in (torch.float16, torch.bfloat16):
        return (OUT_DTYPE, MM_ADD)
    return (ADDMM_UPCAST, MM_ADD)


def temporary_bytes(name: str, rows: int, n: int, k: int, in_dtype: torch.dtype, grad_dtype: torch.dtype) -> int:
    """Bytes a path allocates besides main_grad (the chooser never takes a larger one)."""
    if name == ADDMM_UPCAST:
        item = torch.empty((), dtype=grad_dtype).element_size()
        return rows * (n + k) * item if in_dtype != grad_dtype else 0
    if name == MM_ADD:
        return n * k * torch.empty((), dtype=in_dtype).element_size()
    return 0
