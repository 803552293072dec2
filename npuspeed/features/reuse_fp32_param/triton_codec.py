"""The device codec as one Triton launch per buffer and direction.

The chunked PyTorch device codec (codec.split_device / merge_device) runs several small ops
per 2^20 elements, so a step launches thousands of kernels: on a GPU the cost is launches,
not bytes. Here a split or a merge of a whole flat buffer is one kernel that reads and
writes each element once, with the same results bit for bit and the same dense tie-bit
layout (so either codec can merge what the other split). No host sync.

Runs where triton has a compiler for the tensors' device: CUDA (nvidia/amd backends) and
Ascend NPUs (triton-ascend's `ascend` backend); on CPU tensors only under TRITON_INTERPRET=1
(the tests). Nothing is imported until first use: triton is optional.
"""
from __future__ import annotations

import importlib
import sys

import torch

from npuspeed.accelerator.devices import for_device
from npuspeed.ops.triton._runtime import interpreting  # TRITON_INTERPRET as triton reads it

#: elements per block (a multiple of 8: a block owns whole bytes of tie bits)
BLOCK = 4096
#: the grid is capped (Ascend launches about one program per core); programs loop beyond it
MAX_PROGRAMS = 65535
_KERNELS = "npuspeed.features.reuse_fp32_param._triton_kernels"


def available(device_type: str) -> bool:
    """Whether the Triton codec runs on tensors of `device_type` off the host (CUDA, an NPU
    through triton-ascend): npuspeed's one Triton answer (Accelerator.triton_available)."""
    traits = for_device(device_type)
    return not traits.host_is_device() and traits.triton_available()


def _kernels():
    """The kernel module, decorated in the mode the environment asks for now (the tests set
    TRITON_INTERPRET=1 after another test may have imported it without)."""
    module = sys.modules.get(_KERNELS)
    if module is None:
        return importlib.import_module(_KERNELS)
    if module.INTERPRETED != interpreting():
        module = importlib.reload(module)
    return module


def _launch(n: int, block: int, max_programs: int) -> tuple[tuple[int], int]:
    """(grid, loop count per program) covering `n` elements in blocks of `block`."""
    blocks = -(-n // block)
    programs = max(1, min(max_programs, blocks))
    return (programs,), -(-blocks // programs)


def _check(device: torch.device) -> None:
    if for_device(device).host_is_device() and not interpreting():
        raise RuntimeError("npuspeed: the Triton reuse-fp32-param codec runs on CPU tensors only under "
                           "TRITON_INTERPRET=1 (set it, or unset NPUSPEED_REUSE_CODEC=triton)")


def split(master: torch.Tensor, residual: torch.Tensor, *, block: int = BLOCK,
          max_programs: int = MAX_PROGRAMS) -> torch.Tensor:
    """Low halves of the contiguous fp32 `master` into int16 `residual`; returns the dense tie
    bits (uint8, bit i of byte i // 8 set = element i rounded up to an even bf16)."""
    _check(master.device)
    bits = master.detach().view(-1).view(torch.int32)
    n = bits.numel()
    mask = torch.empty((n + 7) // 8, dtype=torch.uint8, device=bits.device)
    if n:
        grid, iters = _launch(n, block, max_programs)
        _kernels().split_kernel[grid](bits, residual.view(-1), mask, n, BLOCK=block, ITERS=iters)
    return mask


def merge(bf16: torch.Tensor, residual: torch.Tensor, tie_mask: torch.Tensor, out: torch.Tensor, *,
          block: int = BLOCK, max_programs: int = MAX_PROGRAMS) -> None:
    """The exact fp32 values into contiguous `out` from the bf16 values, residual and tie bits."""
    _check(out.device)
    words = out.view(-1).view(torch.int32)
    n = words.numel()
    if n:
        high = bf16.detach().reshape(-1).view(torch.int16)
        grid, iters = _launch(n, block, max_programs)
        _kernels().merge_kernel[grid](high, residual.view(-1), tie_mask, words, n, BLOCK=block, ITERS=iters)
