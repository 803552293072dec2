"""Where megatron.training's CUDA-only pieces live, per Megatron-LM release range.

Upstream moved them (file:line at the tags):
- 0.16-0.17: `megatron/training/utils.py` is a module holding `get_device_arch_version`
  (0.17: :452) and `get_batch_on_this_tp_rank` (0.17: :523, reads the iterator and calls
  `.cuda()`); `pretrain_gpt.py` builds the model through `training.get_model`;
  `megatron.legacy.fused_kernels.load` exists only up to 0.16 (removed in 0.17).
- 0.18-0.19: `megatron/training/utils` is a package: `get_device_arch_version` and the
  `device='cuda'` factories are in `utils/common_utils.py` (0.19: :502, :55-60, :222-227);
  `get_batch_on_this_tp_rank` moved to megatron.core (takes a batch dict, no `.cuda()`);
  the batch's `.cuda(non_blocking=True)` is in the entry script itself (pretrain_gpt.py:128
  at 0.19, a `__main__` function no patch can name) and in `training.py:2311`; 0.19's
  `pretrain_gpt.py` builds the model through `models/dist_utils.py:174` (`.cuda()`), not
  `get_model`. So from 0.18 on, `.cuda()` is mapped for the whole of `training.pretrain`,
  the one call every entry script makes (`tensor_cuda_on`: an attribute swap, no per-op
  hook; the model built inside is on the accelerator either way).
"""
from __future__ import annotations

#: Every release the megatron_lm feature has been checked against.
ALL = ">=0.16,<0.20"
R16_17 = ">=0.16,<0.18"
R18_19 = ">=0.18,<0.20"


#: megatron.legacy.fused_kernels.load (called from initialize.py) exists up to 0.16 only.
FUSED_KERNELS = ">=0.16,<0.17"


# Each target once (the registry takes one registration per target and feature), with the
# releases where it is there and needed.
#: get_device_arch_version, relative to megatron.training.
DEVICE_ARCH = {"utils.get_device_arch_version": R16_17,
               "utils.common_utils.get_device_arch_version": R18_19}
#: is_last_rank (its log line prints there): moved with get_device_arch_version.
LAST_RANK = {"utils.is_last_rank": R16_17, "utils.common_utils.is_last_rank": R18_19}
#: Modules whose `torch` name gets CUDA factory devices mapped (CPU).
TORCH_MODULES = {"training": ALL, "checkpointing": ALL, "initialize": ALL,
                 "utils": R16_17, "utils.common_utils": R18_19}
#: Functions run with Tensor.cuda() mapped (CPU).
CUDA_CALLS = {"utils.get_batch_on_this_tp_rank": R16_17, "training.get_model": R16_17,
              "training.evaluate": R16_17, "training.pretrain": R18_19}


#: Third-party modules megatron.training and pretrain_gpt.py import at load (import name ->
#: (pip name, releases)), found by importing each tag with the module hidden: core_v0.16.1
#: needs all four (tokenizer/, yaml_arguments.py); core_v0.17.0 and core_v0.18.0 only yaml
#: (yaml_arguments.py, config/container.py); core_v0.19.0 none (all imported lazily). The
#: megatron-lm extra installs every one.
LOAD_TIME_IMPORTS = {"regex": ("regex", "<0.17"), "pydantic": ("pydantic", "<0.17"),
                     "six": ("six", "<0.17"), "yaml": ("pyyaml", "<0.19")}
