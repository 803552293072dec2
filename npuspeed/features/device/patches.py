"""The device feature's patches: backend-independent fixes everywhere; off CUDA the MoE helpers
and the NCCL -> gloo/HCCL backend; where the host is the device, the torch.cuda shim, the RNG
tracker and the targeted Megatron patches (cuda_shim.py, rng.py, megatron_fixes.py)."""
from __future__ import annotations


def register(registry, ctx, config, feature: str) -> None:
    """`config` holds --npuspeed-device, which the runtime read to pick `ctx.accelerator`: the
    patches follow the accelerator."""
    from npuspeed.accelerator.devices import for_device
    from npuspeed.features.device import (
        cuda_shim, dist_backend, distopt_fixes, elastic_restart, fused_adam, gloo_collectives, gloo_p2p,
        megatron_compat, megatron_fixes, moe_expert_bias, rng,
    )

    accelerator = ctx.accelerator
    # Backend-independent: WrappedTorchNorm's SP refusal, MoE split sizes off-CUDA.
    registry.register(
        "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__",
        wrapper=megatron_fixes.norm_with_sequence_parallel, feature=feature,
    )
    # moe_utils binds te_general_gemm only when Transformer Engine imports (upstream bug).
    registry.register(
        "megatron.core.transformer.moe.moe_utils.te_general_gemm", None, feature=feature,
        if_missing=True,
    )
    megatron_compat.register(registry, feature)  # older releases' own bugs (0.12)
    moe_expert_bias.register(registry, feature)  # SequentialMLP's in-place expert-bias add (0.15-0.19)
    elastic_restart.register(registry, feature)  # torchrun restarts: each attempt's store keys apart
    gloo_collectives.register(registry, feature)  # MoE's uneven expert-TP gather on gloo
    gloo_p2p.register(registry, feature)  # PP 2 + VPP on gloo: activations and gradients told apart by tag
    from npuspeed.features.pipeline.bubble import patches as bubble

    bubble.register_for_megatron(registry, ctx, feature)  # NPUSPEED_MEASURE_BUBBLE=1: Megatron's timed
    # DistributedOptimizer with torch's Adam (no apex/TE): checkpoint save/load bugs.
    distopt_fixes.register(registry, feature, ">=0.16,<0.20")  # upstream bugs unchanged through 0.19
    # torch's Adam (no apex/TE) built with fused=True where the device has the kernel (--npuspeed-adam)
    fused_adam.register(registry, feature, config.npuspeed_adam)
    traits = for_device(accelerator.name)
    if traits.runs_cuda_code():
        return
    registry.register(
        "megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu",
        megatron_fixes.maybe_move_tensor_to_cpu, feature=feature,
    )
    dist_backend.register(registry, feature)
    if traits.host_is_device():
        cuda_shim.register(registry, accelerator, feature)
        rng.register(registry, feature)
        megatron_fixes.register(registry, accelerator, feature)
