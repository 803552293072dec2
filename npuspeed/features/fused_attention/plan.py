"""--use-flash-attn in `npuspeed plan`: no S x S tensors, except where the CPU kernel cannot run
and SDPA with dropout falls to torch's math backend (the scores stay, in fp32)."""
from __future__ import annotations


def effect(model, config):
    """The flags (`config`) change no slot: the band and sparse mode keep the kernel and its memory;
    the planned device (`model.device`) decides whether npuspeed's CPU kernels apply."""
    from npuspeed.accelerator.devices import for_device
    from npuspeed.features.base import PlanEffect
    from npuspeed.ops import flash_attention as cpu_flash

    if model.layout.cp > 1:
        return None  # every call goes to context parallelism, whose plan effect states it
    flash = PlanEffect(
        variants={"core_attention": "flash"}, kernels={"attention": "flash"},
        summary="no S x S tensors: the score buffer, softmax, dropout mask and dropped probabilities "
                "of every layer go; q, k, v, the output and a [b, heads, s] log-sum-exp stay")
    if not for_device(model.device).host_is_device():
        return flash
    bf16 = model.batch.dtype == "bf16"
    reason = cpu_flash.machine_reason() if bf16 else cpu_flash.fp32_reason()
    if reason is None and bf16 and model.model.kv_channels % 16:
        reason = f"head dim {model.model.kv_channels} is not a multiple of 16"
    if reason is None or model.model.attention_dropout <= 0:
        return flash  # npuspeed's CPU kernels (dropout inside), or SDPA's flash kernel
    return PlanEffect(
        variants={"core_attention": "sdpa_math"}, kernels={"attention": "sdpa_math"},
        summary=f"npuspeed's CPU kernel cannot run here ({reason}) and scaled_dot_product_attention "
                "with dropout runs torch's math backend: the S x S softmax, mask and dropped "
                "probabilities stay, in fp32 with fp32 copies of q, k, v")
