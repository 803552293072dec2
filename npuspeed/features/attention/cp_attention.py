"""Core attention under context parallelism or over packed documents: the fused path's seam.

Fused attention (`--use-flash-attn`) hands a call here when the layer was built under CP
(the CP feature marked it, see context_parallel/patches.py) or Megatron passed `packed_seq_params`. One
algorithm covers every case (layout.py): Ulysses all-to-all when U > 1, then ring attention
over R positions (a ring of one at CP 1 or under pure Ulysses), then the all-to-all back.
"""
from __future__ import annotations

import contextlib

import torch

from npuspeed.accelerator.devices import for_device
from npuspeed.features.base import FeatureError
from npuspeed.features.attention import documents, groups
from npuspeed.features.attention.blocks import CallSpec
from npuspeed.features.attention.kernels_cpu import cpu_kernel
from npuspeed.features.attention.layout import CPLayout, ulysses_order
from npuspeed.features.attention.ring import RingAttention, RingPlan
from npuspeed.features.attention.ulysses import Exchange, head_to_seq, seq_to_head
from npuspeed.features.attention.dropout import draw_seed_offset, global_head0
from npuspeed.ops import npu

ATTR = "npuspeed_cp_layout"  # set on DotProductAttention by the CP feature's __init__ wrapper
NO_CP = CPLayout("megatron_cp_algo", 1, 1, 1)


def active(module, packed_seq_params=None) -> bool:
    return packed_seq_params is not None or getattr(module, ATTR, None) is not None


def _kernel(query, key, dropout_p: float, accelerator):
    if accelerator is not None and for_device(accelerator.name).has_vendor_kernels() \
            and accelerator.has_fused_attention():
        from npuspeed.features.attention.kernels_device import NpuFusion

        return NpuFusion(npu.of(accelerator)), "the NPU's fused kernel"
    if for_device(query).has_sdpa_kernels():
        from npuspeed.features.attention.kernels_device import CudaAten

        return CudaAten(query.dtype), "PyTorch's CUDA kernel"
    if not for_device(query).host_is_device():
        raise FeatureError(f"context parallelism / packed documents on {query.device.type} need a kernel that "
                           "returns the log-sum-exp (npu_fusion_attention on NPU, PyTorch's flash/efficient on "
                           "CUDA); this one has none: update torch_npu or drop --context-parallel-size")
    return cpu_kernel(query, key, dropout_p)


def _check_masks(module, attention_mask, cp: CPLayout, packed) -> bool:
    """The layer's causality; a mask CP/documents cannot honour is an error naming the fix."""
    what = f"--context-parallel-size {cp.size}" if cp.size > 1 else "packed documents (packed_seq_params)"
    kind = module.attn_mask_type.name
    if kind not in ("causal", "no_mask"):
        raise FeatureError(f"{what} supports causal and no_mask attention, not attn_mask_type={kind}")
    if attention_mask is not None:
        raise FeatureError(
            f"{what} takes no attention_mask tensor (it would be S x S): a causal layer needs none "
            "(Megatron-LM: --no-create-attention-mask-in-dataloader) and packed documents come as "
            "PackedSeqParams (the example's --reset-attention-mask)")
    if getattr(module.scale_mask_softmax, "window_size", None) is not None:
        raise FeatureError(f"{what} does not support sliding-window attention (window_size)")
    return kind == "causal"


def _dropout(module, head0: int) -> tuple[float, int, int, int]:
    """(p, seed, offset, head0), drawn as the CP 1 kernel path draws them: inside the tracker's
    fork unless sequence parallelism already forked; the same on every CP rank."""
    p = float(module.attention_dropout.p) if module.training else 0.0
    if p == 0.0:
        return 0.0, 0, 0, 0
    if module.config.sequence_parallel:
        seed, offset = draw_seed_offset()
    else:
        from megatron.core import tensor_parallel

        with tensor_parallel.get_cuda_rng_tracker().fork():
            seed, offset = draw_seed_offset()
    return p, seed, offset, global_head0(module) + head0


def _kernel_rng(module):
    """Where a device kernel that draws its own dropout takes its random state: Megatron's
    model-parallel tracker, as Megatron's attention dropout does (already forked under SP)."""
    if module.config.sequence_parallel:
        return contextlib.nullcontext()
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker().fork()


def attention(module, query, key, value, attention_mask, packed_seq_params, accelerator, scale: float):
    """-> (context [s, b, hq * d], kernel label, why) for one core attention call."""
    cp = getattr(module, ATTR, None) or NO_CP
    thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
    if thd:
        if cp.size > 1:
            raise FeatureError("packed sequences in qkv_format 'thd' with --context-parallel-size > 1 need "
                               "Transformer Engine's per-document CP split; use qkv_format 'sbhd' "
                               "(PackedSeqParams with global cu_seqlens, as the example builds)")
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    causal = _check_masks(module, attention_mask, cp, packed_seq_params)
    s_local, b, hq, d = query.shape
    if s_local % 2 and cp.size > 1:
        raise FeatureError(f"--context-parallel-size {cp.size}: this rank's {s_local} tokens are not two "
                           "equal chunks; the sequence length must divide by 2 x CP")
    u_group, r_group = groups.for_layout(cp)
    u_index = groups.rank(u_group)
    dropout_p, seed, offset, head0 = _dropout(module, u_index * (hq // cp.ulysses))
    kernel, why = _kernel(query, key, dropout_p, accelerator)
    per_call = dropout_p > 0 and not kernel.dropout and cp.size == 1 and kernel.per_call_dropout
    if dropout_p > 0 and not kernel.dropout and not per_call:
        raise FeatureError(f"attention dropout under {'CP' if cp.size > 1 else 'packed documents'} needs a "
                           f"kernel that draws it at global positions; {kernel.name} does not: set "
                           "--attention-dropout 0")
    seq = s_local * cp.size  # the global sequence
    docs = documents.from_packed(packed_seq_params, b, seq, query.device) if packed_seq_params is not None else None
    if cp.ulysses > 1:
        order = ulysses_order(cp.ulysses, s_local, device=query.device)
        query = Exchange.apply(query, seq_to_head, u_group, cp.ulysses, order, 0)
        kv = Exchange.apply(torch.stack([key, value]), seq_to_head, u_group, cp.ulysses, order, 1)
        key, value = kv[0], kv[1]
    plan = RingPlan(peers=groups.peers(r_group), size=cp.ring, position=groups.rank(r_group),
                    chunk=seq // (2 * cp.ring), causal=causal, kernel=kernel,
                    spec=CallSpec(scale, dropout_p, seed, offset, head0), docs=docs)
    with _kernel_rng(module) if per_call else contextlib.nullcontext():
        out = RingAttention.apply(query, key, value, plan)
    if cp.ulysses > 1:
        out = Exchange.apply(out, head_to_seq, u_group, cp.ulysses, order, 0)
    context = out.reshape(out.shape[0], -1) if thd else out.reshape(s_local, b, -1)
    mode = f"CP{cp.size} {cp.short}" + (f" (Ulysses {cp.ulysses} x ring {cp.ring})" if cp.algo == "hybrid_cp_algo"
                                        else "") if cp.size > 1 else "CP1"
    label = f"{kernel.name}+{cp.short if cp.size > 1 else 'documents'}"
    doc_text = f", {docs.count} packed documents" if docs is not None else ""
    if docs is not None and kernel.varlen:
        doc_text += " (one varlen call per block)"
    return context, label, f"{mode}{doc_text}: blocks on {why}"
