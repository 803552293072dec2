"""Megatron-LM integration (on whenever `megatron.training` is importable).

With `import npuspeed.megatron_adaptor` after `import torch`, Megatron-LM's own entry
scripts (`pretrain_gpt.py` ...) run unchanged on CPU (gloo) and NPU:
- its parser learns npuspeed's flags, sharing the ones Megatron-LM already defines
  (`--use-flash-attn`), so a MindSpeed-style launch script keeps working;
- modules megatron.training imports at load time whose optional dependency is absent get a
  stand-in (load_stubs.py: batch_invariant_kernels without triton);
- `validate_args` picks the portable choice for what this machine lacks (validate.py);
- megatron.training's own CUDA calls go to the accelerator (device_fixes.py,
  device/redirect.py), the dataset helper is built for the running Python (build_helpers.py);
- three upstream DistributedOptimizer bugs on the path without apex/TE, which `--load`
  meets, are fixed by the device feature (device/distopt_fixes.py), since megatron.core
  alone meets them too.
The training patches are verified against Megatron-LM core_v0.16.x to core_v0.19.x, each
where upstream put it in that release (targets.py); for another release they are skipped and
the report says so (MEGATRON_LM_RANGE).
"""
from __future__ import annotations

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.device.module_proxy import DeviceMappedTorch
from npuspeed.features.device.redirect import cuda_calls_on_device
from npuspeed.features.megatron_lm import build_helpers, device_fixes, load_stubs, parser, targets, validate
from npuspeed.patching.versions import importable, in_range

#: Megatron-LM versions (read from the checkout's megatron/core/package_info.py) whose
#: megatron.training these patches were checked against.
MEGATRON_LM_RANGE = targets.ALL
MLT = "megatron.training"
#: Modules megatron.training imports at load (import name -> pip name, releases): the megatron-lm extra.
LOAD_TIME_IMPORTS = targets.LOAD_TIME_IMPORTS


_importable = importable  # a name of its own: tests replace it


def megatron_lm_present() -> bool:
    return importable("megatron.training")


class MegatronLMFeature(Feature):
    name = "megatron_lm"
    plan_neutral = True  # Megatron-LM plumbing: no memory or time of its own in the plan
    always_on = True

    def enabled(self, args) -> bool:
        return megatron_lm_present()

    def validate(self, ctx) -> None:
        missing = [pip for module, (pip, releases) in LOAD_TIME_IMPORTS.items()
                   if in_range(releases) and not _importable(module)]
        if missing:
            raise FeatureError(
                f"megatron.training (Megatron-LM) is on the path but imports {', '.join(missing)} at "
                f"load, which {'is' if len(missing) == 1 else 'are'} not installed: "
                "`pip install 'npuspeed[megatron-lm]'` (or `pip install " + " ".join(missing) + "`)")

    def prepare(self, ctx) -> None:
        load_stubs.install()

    def register_patches(self, registry, ctx) -> None:
        reg, accelerator, name = registry.register, ctx.accelerator, self.name
        reg(f"{MLT}.arguments.parse_args", wrapper=parser.parse_args_wrapper(ctx.extend_parser), feature=name)
        reg(f"{MLT}.arguments.validate_args", wrapper=validate.validate_args_wrapper(accelerator.name, ctx.note),
            feature=name, megatron=MEGATRON_LM_RANGE)
        reg("megatron.core.datasets.utils.compile_helpers", build_helpers.compile_helpers,
            feature=name, megatron=MEGATRON_LM_RANGE)
        traits = for_device(accelerator.name)
        if traits.runs_cuda_code():
            return
        reg("megatron.legacy.fused_kernels.load", device_fixes.fused_kernels_skipper(ctx.note),
            feature=name, megatron=targets.FUSED_KERNELS)
        for target, rng in targets.DEVICE_ARCH.items():  # moved between releases (targets.py)
            reg(f"{MLT}.{target}", validate.device_arch_version, feature=name, megatron=rng)
        if not traits.host_is_device():
            return  # NPU: transfer_to_npu maps factories and Tensor.cuda itself
        for module, rng in targets.TORCH_MODULES.items():
            reg(f"{MLT}.{module}.torch", DeviceMappedTorch(accelerator.device), feature=name, megatron=rng)
        for target, rng in targets.CUDA_CALLS.items():
            reg(f"{MLT}.{target}", wrapper=cuda_calls_on_device(accelerator.device), feature=name,
                megatron=rng)

    def path(self, ctx) -> str:
        accelerator = ctx.accelerator
        stubs = load_stubs.installed()
        extra = f"; stand-ins: {', '.join(stubs)}" if stubs else ""
        return (f"megatron.training found: its parser learns npuspeed's flags, validation and "
                f"its CUDA calls mapped to {accelerator.name}{extra}")
