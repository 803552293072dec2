"""Targeted patches for the places where megatron.core assumes CUDA.

Each entry is small and names the Megatron function it touches; together with the
`torch.cuda` shim they are the device feature's whole footprint (see `npuspeed report`).
"""
from __future__ import annotations

import copy
import functools

import torch

from npuspeed.accelerator import get_accelerator
from npuspeed.accelerator.devices import for_device
from npuspeed.features.cuda_mapping.module_proxy import DeviceMappedTorch
from npuspeed.features.cuda_mapping.redirect import on_device
from npuspeed.features.device.rng import in_device_rng_scope

_MC = "megatron.core"

# Functions that create tensors with device='cuda', call .cuda(), or check CUDA type strings.
DEVICE_REDIRECTS = [
    "optimizer.optimizer.MixedPrecisionOptimizer.__init__",
    "optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__",
    "optimizer.optimizer.FP32Optimizer.__init__",
    "optimizer.optimizer.MegatronOptimizer.has_grad_norm_group",
    "optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.has_grad_norm_group",
    "optimizer.clip_grads.get_grad_norm_fp32",
    "optimizer.clip_grads.clip_grad_by_total_norm_fp32",
    "optimizer.clip_grads.count_zeros_fp32",
    "optimizer.grad_scaler.MegatronGradScaler.__init__",
    "optimizer.grad_scaler.DynamicGradScaler.__init__",
    "optimizer.grad_scaler.DynamicGradScaler.load_state_dict",
    "optimizer.distrib_optimizer.DistributedOptimizer.__init__",
    "optimizer.distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups",
    "optimizer.distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_zero",
    "transformer.utils.get_default_causal_mask",
    "transformer.utils.get_sliding_window_causal_mask",
    "rerun_state_machine.RerunStateMachine._reduce_any",
    "rerun_state_machine.RerunStateMachine.should_run_forward_backward",
    "models.common.language_module.language_module.LanguageModule.setup_embeddings_and_output_layer",
    "transformer.moe.moe_utils.track_moe_metrics",
    "utils.local_multi_tensor_l2_norm",
    "utils.check_param_hashes_across_dp_replicas",
    "utils.get_batch_on_this_cp_rank",
]

# Targets that exist (or need the fix) only in part of the supported range; the rest: ">=0.12".
# Before 0.16 the rerun state machine made its all-reduce flags on 'cuda' inline in
# should_run_forward_backward; 0.16 moved that into _reduce_any.
MEGATRON_RANGES = {
    "transformer.utils.get_sliding_window_causal_mask": ">=0.15",
    "rerun_state_machine.RerunStateMachine._reduce_any": ">=0.16",
    "rerun_state_machine.RerunStateMachine.should_run_forward_backward": "<0.16",
    # 0.19: a cached all-reduce flag on 'cuda' before the first clipped step.
    "optimizer.optimizer.MegatronOptimizer.has_grad_norm_group": ">=0.19",
    "optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.has_grad_norm_group": ">=0.19",
    # 0.12-0.13: the CP index is made with pin_memory=True on the host, then `.cuda()`.
    "utils.get_batch_on_this_cp_rank": "<0.14",
}

# The schedules run in the device RNG scope; the `total_num_tokens` tensor they make on
# 'cuda' is mapped by giving the module its own `torch` (see cuda_mapping/module_proxy.py).
SCHEDULES = [
    "pipeline_parallel.schedules.forward_backward_no_pipelining",
    "pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving",
    "pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving",
]

# Before 0.14 the pipelined schedules made that tensor with `torch.tensor(0).cuda()`, which
# the module's `torch` cannot see: there they also run under the redirect mode.
SCHEDULES_CUDA_CALL = SCHEDULES[1:]


def norm_with_sequence_parallel(new):
    """WrappedTorchNorm refuses sequence parallelism only because it cannot mark its
    parameters; build it without SP, then mark them so Megatron all-reduces their grads
    across the tensor-parallel group, as it does for its fused norms."""

    @functools.wraps(new)
    def __new__(cls, config, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return new(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        object.__setattr__(plain, "sequence_parallel", False)
        norm = new(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return __new__


def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
    """Upstream converts only when `tensor.is_cuda`, so on CPU and NPU the MoE all-to-all
    receives tensors instead of numpy split sizes. Convert whatever the device."""
    if not torch.is_tensor(tensor):
        return tensor
    on_device_tensor = not for_device(tensor).host_is_device()
    result = tensor.to(torch.device("cpu"), non_blocking=on_device_tensor)
    if as_numpy:
        result = result.numpy()
    if record_stream and on_device_tensor:
        tensor.record_stream(get_accelerator().current_stream())
    return result


def register(registry, accelerator, feature: str) -> None:
    device_fn = accelerator.device
    for target in DEVICE_REDIRECTS:
        registry.register(f"{_MC}.{target}", wrapper=on_device(device_fn), feature=feature,
                          megatron=MEGATRON_RANGES.get(target, ">=0.12"))
    for target in SCHEDULES:
        registry.register(f"{_MC}.{target}", wrapper=in_device_rng_scope, feature=feature)
    for target in SCHEDULES_CUDA_CALL:
        registry.register(f"{_MC}.{target}", wrapper=on_device(device_fn), feature=feature,
                          megatron="<0.14")
    registry.register(f"{_MC}.pipeline_parallel.schedules.torch", DeviceMappedTorch(device_fn),
                      feature=feature)
