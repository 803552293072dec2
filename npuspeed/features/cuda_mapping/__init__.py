"""Shared room: Megatron's code written for CUDA run on the accelerator's device.

Both the device feature (megatron.core's functions and schedules) and the Megatron-LM feature
(megatron.training's) map Megatron's `device='cuda'`, `.cuda()` and `torch.cuda.FloatTensor`
checks onto the run's accelerator the same way, so the mapping lives here rather than in
either folder: redirect.py (a scoped `.cuda()` mapping and a TorchFunctionMode for named
functions) and module_proxy.py (a module's own `torch` whose tensor factories map a CUDA
device). No flag and no class of its own; the features register the patches that use them.
"""
