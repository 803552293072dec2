"""npuspeed's stand-in for apex's `fused_weight_gradient_mlp_cuda`.

Megatron-Core's linear layers (LinearWithGradAccumulationAndAsyncCommunication, and
npuspeed's --use-coc layers, which call the same module) compute the weight gradient with
`wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)` (fp32 main_grad) or
`wgrad_gemm_accum_fp16(...)` (main_grad in the model's 16-bit dtype), both adding
`grad_output^T @ total_input` into `main_grad` in place. Providing the same two functions
keeps Megatron's own code path (sequence-parallel all-gather, async dgrad collectives,
`grad_added_to_main_grad` so that the DDP hook does not add the grad again) unchanged.
"""
from __future__ import annotations

import torch

from npuspeed import telemetry
from npuspeed.features.grad_accum_fusion.candidates import PREFIX

_16BIT = (torch.float16, torch.bfloat16)


class WgradAccumulator:
    """What `megatron.core.tensor_parallel.layers.fused_weight_gradient_mlp_cuda` names."""

    __name__ = "npuspeed.fused_weight_gradient_mlp"

    def __init__(self, chooser):
        self.chooser = chooser

    def _accumulate(self, total_input, grad_output, main_grad, kind: str) -> None:
        x = total_input.reshape(-1, total_input.shape[-1])
        g = grad_output.reshape(-1, grad_output.shape[-1])
        if tuple(main_grad.shape) != (g.shape[1], x.shape[1]):
            raise RuntimeError(f"npuspeed wgrad_gemm_accum_{kind}: main_grad {tuple(main_grad.shape)} does not "
                               f"match grad_output^T @ input ({g.shape[1]}, {x.shape[1]})")
        telemetry.count(PREFIX + "calls")
        if x.shape[0] == 0:
            return
        self.chooser.run(g, x, main_grad)

    def wgrad_gemm_accum_fp32(self, total_input, grad_output, main_grad) -> None:
        """main_grad (fp32) += grad_output^T @ total_input; inputs fp32 or 16-bit."""
        if main_grad.dtype != torch.float32:
            raise RuntimeError(f"wgrad_gemm_accum_fp32 needs an fp32 main_grad, got {main_grad.dtype}")
        self._accumulate(total_input, grad_output, main_grad, "fp32")

    def wgrad_gemm_accum_fp16(self, total_input, grad_output, main_grad) -> None:
        """main_grad (fp16/bf16, the inputs' dtype) += grad_output^T @ total_input."""
        if main_grad.dtype not in _16BIT:
            raise RuntimeError(f"wgrad_gemm_accum_fp16 needs a 16-bit main_grad, got {main_grad.dtype}")
        if total_input.dtype != main_grad.dtype or grad_output.dtype != main_grad.dtype:
            total_input, grad_output = total_input.to(main_grad.dtype), grad_output.to(main_grad.dtype)
        self._accumulate(total_input, grad_output, main_grad, "fp16")
