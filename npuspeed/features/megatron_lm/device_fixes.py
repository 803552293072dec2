"""megatron.training's own CUDA calls, answered by the accelerator (CPU; NPU in part).

megatron.core's CUDA assumptions are the device feature's; these are the ones
megatron.training adds (file:line at core_v0.16.1):
- literal `device='cuda'` tensor factories in `training.py` (806, 812, 1816, 2072, 2373,
  3149, 3225, 3406), `utils.py` (117-208, the params-norm buffers), `checkpointing.py`
  (315), `initialize.py` (475-512, the JIT warm-up): each of those modules gets the mapped
  `torch` the device feature uses too (factories only; nothing else changes; cuda_mapping/module_proxy.py);
- `Tensor.cuda()` in `get_batch_on_this_tp_rank` (utils.py:534, every step), `get_model`
  (training.py:1258) and `evaluate` (training.py:3112): mapped for the call (cuda_mapping/redirect.py: tensor_cuda_on);
- `megatron.legacy.fused_kernels.load` (initialize.py:224) runs `$CUDA_HOME/bin/nvcc -V`
  for the legacy models' CUDA softmax, which megatron.core models do not use: off CUDA it
  is skipped, with a note;
- `get_device_arch_version` (utils.py:448) reads CUDA device properties (validate.py).
The rest (`torch.cuda.set_device`, `device_count`, `is_available`, RNG state in the rerun
state machine and in checkpoints, memory statistics, `synchronize` in timers, streams)
goes through the device feature's `torch.cuda` shim, which therefore must be installed:
see `shim_names_needed()`, checked by the tests.
"""
from __future__ import annotations

MLT = "megatron.training"

# Modules whose `torch` global becomes the factory-mapping proxy (CPU).
TORCH_PROXY_MODULES = ("training", "utils", "checkpointing", "initialize")

# Functions calling Tensor.cuda()/Module.cuda() directly (CPU).
CUDA_CALLS = ("utils.get_batch_on_this_tp_rank", "training.get_model", "training.evaluate")

# torch.cuda names megatron.training calls on the way of a pretrain_gpt.py run.
SHIM_NAMES_NEEDED = ("is_available", "device_count", "set_device", "current_device",
                     "get_rng_state", "set_rng_state", "empty_cache", "memory_allocated",
                     "max_memory_allocated", "memory_reserved", "max_memory_reserved",
                     "synchronize", "Stream", "current_stream", "stream")


def shim_names_needed() -> tuple[str, ...]:
    return SHIM_NAMES_NEEDED


def fused_kernels_skipper(note):
    """The replacement for megatron.legacy.fused_kernels.load off CUDA; says so through `note`."""

    def skip_fused_kernels(args) -> None:
        note("npuspeed: Megatron's legacy CUDA fused kernels (megatron/legacy/fused_kernels) "
             "are not built off CUDA; megatron.core models do not use them")

    return skip_fused_kernels
