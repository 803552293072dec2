"""The replacement for `DotProductAttention.forward`, and the choice of kernel per call.

The scale is Megatron's: `softmax_scale` (1/sqrt(d) unless given), divided by the layer
number under `apply_query_key_layer_scaling` and multiplied back by the softmax, so the
product is what the kernel gets. Dropout is drawn as upstream draws it: inside the
model-parallel RNG tracker's fork unless sequence parallelism is on (then the transformer
block has already forked), so tensor-parallel ranks stay consistent and reproducible; the
CPU kernels take a (seed, offset) drawn there (features/attention/dropout.py) and regenerate the mask in backward.

Per call on CPU: npuspeed's kernel (bf16 or fp32) when the mask is per-row key ranges
(causal, padding, bands, packed documents: kernel_rows.py), else the measured choice between
SDPA and Megatron's own unfused forward (candidates.py). Every call is counted by kernel
(telemetry `attention.kernel.<kernel>`), with why it ran that kernel
(`telemetry.last("attention.why.<kernel>")`) and the latest call's details
(`telemetry.last("attention")`), so a test can prove which path ran and the report can say why.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from npuspeed import telemetry
from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import FeatureError
from npuspeed.features.attention import cp_attention
from npuspeed.features.fused_attention.candidates import UNFUSED, AttentionFallback
from npuspeed.features.fused_attention.kernel_rows import cpu_flash_run, kernel_rows
from npuspeed.features.fused_attention.npu import npu_attention
from npuspeed.features.fused_attention.masks import BandOptions, plan_masks
from npuspeed.features.fused_attention.sdpa import sdpa_attention
from npuspeed.ops import npu
from npuspeed.ops import flash_attention as cpu_flash

SUPPORTED_MASK_TYPES = ("causal", "padding", "no_mask", "arbitrary")
CPU_FLASH = "npuspeed_flash_bf16"  # csrc/x86/flash_attention_bf16.cpp, for the calls it covers
CPU_FLASH_FP32 = "npuspeed_flash_fp32"  # csrc/cpu/flash_attention_fp32.cpp
TARGET = "megatron.core.transformer.dot_product_attention.DotProductAttention.forward"


KERNEL = "attention.kernel."  # counter prefix, one counter per kernel
WHY = "attention.why."  # telemetry.last(WHY + kernel)["why"]: why the latest call ran it
FALLBACK = "attention.fallback"  # telemetry.last(FALLBACK): the latest measured fallback choice
LAST = "attention"  # telemetry.last(LAST): the latest call's kernel, mask, shapes

def kernel_calls() -> dict[str, int]:
    """Calls so far by kernel name ("sdpa", CPU_FLASH, CPU_FLASH_FP32, "megatron_unfused", ...)."""
    return {name[len(KERNEL):]: n for name, n in telemetry.snapshot(KERNEL).items()}


def attention_calls() -> dict:
    """For the report: calls by kernel, why each kernel ran, the latest measured fallback."""
    calls = kernel_calls()
    return {"calls": calls, "reasons": {k: telemetry.last(WHY + k).get("why", "") for k in calls},
            "fallback": telemetry.last(FALLBACK)}


@dataclass(frozen=True)
class KernelChoice:
    """What `register_patches` decided once: the kernel and the flags that shape it."""

    kernel: str  # "sdpa" | "npu_fusion_attention" (per call, "sdpa" may run a CPU kernel instead)
    band: BandOptions
    sparse_mode: int | None
    accelerator: object
    fallback: AttentionFallback = field(default_factory=AttentionFallback, compare=False)


def check_module(module) -> None:
    """Raise FeatureError for a layer configuration the fused path cannot reproduce."""
    mask_type = module.attn_mask_type.name
    if mask_type not in SUPPORTED_MASK_TYPES:
        raise FeatureError(
            f"--use-flash-attn does not support attn_mask_type={mask_type} in DotProductAttention "
            f"(supported: {', '.join(SUPPORTED_MASK_TYPES)}): Megatron's local path applies only "
            "the given mask for it, other backends add causal masking. Pass a combined boolean "
            "mask with attn_mask_type=arbitrary, or drop --use-flash-attn."
        )
    if getattr(module, "softmax_offset", None) is not None:
        raise FeatureError(
            f"--use-flash-attn does not support softmax_type={module.config.softmax_type!r} "
            "(a softmax offset / attention sink); use softmax_type='vanilla' or drop --use-flash-attn."
        )


def effective_scale(module) -> float:
    coeff = getattr(module.scale_mask_softmax, "scale", None)
    return float(module.softmax_scale * (coeff if coeff is not None else 1.0))


def init_wrapper(init):
    """Check the configuration when the layer is built, not at its first step."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        check_module(self)

    return __init__


def _fp32_takes_bf16(query, key, rows, dropout_p: float) -> bool:
    """bf16 calls the bf16 kernel cannot take (no AVX512-BF16, an Arm host, a head dim it does
    not tile) run the portable fp32 kernel on fp32 copies: O(S x d), not S x S."""
    return (rows is not None and query.dtype == torch.bfloat16 and key.dtype == torch.bfloat16
            and for_device(query).host_is_device() and for_device(key).host_is_device()
            and cpu_flash.fp32_reason() is None and 0.0 <= dropout_p < 1.0)


def _unfused(module, attention_mask, attn_mask_type):
    from npuspeed.patching import registry

    original = registry.original(TARGET)
    return lambda q, k, v: original(module, q, k, v, attention_mask, attn_mask_type=attn_mask_type)


def make_forward(choice: KernelChoice):
    """Build the replacement forward for one kernel choice."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise FeatureError("--use-flash-attn: attention_bias is not supported by DotProductAttention")
        check_module(self)
        if cp_attention.active(self, packed_seq_params):  # context parallelism / packed documents
            context, kernel, why = cp_attention.attention(self, query, key, value, attention_mask, packed_seq_params,
                                                          choice.accelerator, effective_scale(self))
            telemetry.count(KERNEL + kernel)
            telemetry.record(WHY + kernel, why=why)
            return context
        sq, sk = query.shape[0], key.shape[0]
        # attn_mask_type from the caller is ignored, as upstream's forward ignores it.
        plan = plan_masks(
            attn_mask_type_name=self.attn_mask_type.name,
            attention_mask=attention_mask,
            window_size=getattr(self.scale_mask_softmax, "window_size", None),
            sq=sq, sk=sk, options=choice.band,
        )
        dropout_p = float(self.attention_dropout.p) if self.training else 0.0
        masked = plan.band is not None or plan.mask is not None
        scale = effective_scale(self)
        kernel, why, fork = choice.kernel, "", dropout_p > 0.0 and not self.config.sequence_parallel
        if kernel == "npu_fusion_attention":
            why = "the NPU's fused kernel"
            run = functools.partial(npu_attention, npu.of(choice.accelerator), query, key, value, plan,
                                    scale=scale, dropout_p=dropout_p, sparse_mode=choice.sparse_mode)
        else:
            rows = kernel_rows(plan, attention_mask, query.shape[1], sq, sk)
            reason = cpu_flash.unsupported(query, key, masked=rows is None, dropout_p=dropout_p)
            upcast = reason is not None and _fp32_takes_bf16(query, key, rows, dropout_p)
            if reason is None or upcast:
                kernel = CPU_FLASH if query.dtype == torch.bfloat16 and not upcast else CPU_FLASH_FP32
                why = f"{rows.source}, {str(query.dtype).replace('torch.', '')}" + (
                    f", dropout {dropout_p:g} in the kernel" if dropout_p else "") + (
                    f", on the fp32 kernel ({reason})" if upcast else "")
                run = functools.partial(cpu_flash_run, self, query, key, value, rows, scale=scale,
                                        dropout_p=dropout_p, upcast=upcast)
            else:
                sdpa = functools.partial(sdpa_attention, plan=plan, scale=scale, dropout_p=dropout_p)
                unfused = _unfused(self, attention_mask, attn_mask_type)
                shape_key = (str(query.dtype), tuple(query.shape), tuple(key.shape), plan.source,
                             dropout_p > 0.0)
                picked = choice.fallback.choose(shape_key, sdpa, unfused, (query, key, value), choice.accelerator)
                kernel, why = picked["kernel"], f"{reason}; {picked['why']}"
                telemetry.record(FALLBACK, shape=str(shape_key), **picked)
                if kernel == UNFUSED:  # Megatron's forward forks the tracker itself
                    run, fork = functools.partial(unfused, query, key, value), False
                else:
                    run = functools.partial(sdpa, query, key, value)
        if fork:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = run()
        else:
            context = run()
        telemetry.count(KERNEL + kernel)
        telemetry.record(WHY + kernel, why=why)
        telemetry.record(
            LAST, kernel=kernel, why=why, mask=plan.source, causal=plan.causal,
            band=plan.band, masked=masked, gqa=query.shape[2] != key.shape[2], dropout_p=dropout_p,
            scale=scale, dtype=str(query.dtype), shape=tuple(query.shape),
        )
        return context

    return forward
