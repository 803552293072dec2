"""Megatron-LM's patches: its parser learns npuspeed's flags, `validate_args` takes the portable
defaults, the dataset helper builds for this Python; off CUDA its fused-kernel build is skipped
and the device-architecture probe answers; where the host is the device, megatron.training's
`torch.cuda` calls and factories go to the accelerator (each target per release: targets.py)."""
from __future__ import annotations

MLT = "megatron.training"


def register(registry, ctx, config, feature: str) -> None:
    """`config` is the feature's (empty) Config: what applies depends on the backend alone."""
    from npuspeed.accelerator.devices import for_device
    from npuspeed.features.cuda_mapping.module_proxy import DeviceMappedTorch
    from npuspeed.features.cuda_mapping.redirect import cuda_calls_on_device
    from npuspeed.features.megatron_lm import build_helpers, device_fixes, parser, targets, validate

    reg, accelerator, every = registry.register, ctx.accelerator, targets.ALL
    reg(f"{MLT}.arguments.parse_args", wrapper=parser.parse_args_wrapper(ctx.extend_parser), feature=feature)
    reg(f"{MLT}.arguments.validate_args", wrapper=validate.validate_args_wrapper(accelerator.name, ctx.note),
        feature=feature, megatron=every)
    reg("megatron.core.datasets.utils.compile_helpers", build_helpers.compile_helpers, feature=feature,
        megatron=every)
    from npuspeed.features.pipeline.which import v_schedule

    if v_schedule(ctx.args):  # the loss is on pipeline rank 0 under the V
        from npuspeed.features.pipeline.v_placement import reporting_rank_wrapper

        for target, rng in targets.LAST_RANK.items():
            reg(f"{MLT}.{target}", wrapper=reporting_rank_wrapper, feature=feature, megatron=rng)
    traits = for_device(accelerator.name)
    if traits.runs_cuda_code():
        return
    reg("megatron.legacy.fused_kernels.load", device_fixes.fused_kernels_skipper(ctx.note),
        feature=feature, megatron=targets.FUSED_KERNELS)
    for target, rng in targets.DEVICE_ARCH.items():  # moved between releases (targets.py)
        reg(f"{MLT}.{target}", validate.device_arch_version, feature=feature, megatron=rng)
    if not traits.host_is_device():
        return  # NPU: transfer_to_npu maps factories and Tensor.cuda itself
    for module, rng in targets.TORCH_MODULES.items():
        reg(f"{MLT}.{module}.torch", DeviceMappedTorch(accelerator.device), feature=feature, megatron=rng)
    for target, rng in targets.CUDA_CALLS.items():
        reg(f"{MLT}.{target}", wrapper=cuda_calls_on_device(accelerator.device), feature=feature, megatron=rng)
