"""Megatron-LM's argument validation on a machine without CUDA, Transformer Engine or apex.

`validate_args` (megatron/training/arguments.py, 0.16) asks the GPU for its architecture
(`get_device_arch_version` -> `torch.cuda.get_device_properties`, which does not exist on
a CPU build) and then asserts `CUDA_DEVICE_MAX_CONNECTIONS=1` for TP/CP; its defaults
(`--transformer-impl transformer_engine`, gradient-accumulation fusion on) need Transformer
Engine and apex's `fused_weight_gradient_mlp_cuda`, and fail later, far from the flag
(`NameError: TESpecProvider`, a RuntimeError at the first linear layer, torch LayerNorm's
assertion against `persist_layer_norm`, "apply_rope_fusion is not available" with RoPE, `import scaled_masked_softmax_cuda` failing
in bf16/fp16 attention).

The wrapper below turns each of those defaults into the portable choice before upstream
validates, and says so in the log and in `npuspeed report` (the run's note sink). An explicit
setting the machine cannot honour is switched the same way, with the note naming it.
"""
from __future__ import annotations

import functools
import os

from npuspeed.accelerator.devices import for_device
from npuspeed.patching.versions import importable

_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def have_transformer_engine() -> bool:
    return importable("transformer_engine")


def have_grad_accum_fusion() -> bool:
    """Whether megatron.core found apex's fused wgrad kernel (what it checks at run time)."""
    from megatron.core.tensor_parallel import layers

    return bool(getattr(layers, "_grad_accum_fusion_available", False))


def have_persist_layer_norm() -> bool:
    """Whether megatron.core found apex's persistent LayerNorm kernel."""
    from megatron.core.fusions import fused_layer_norm

    return bool(getattr(fused_layer_norm, "HAVE_PERSIST_LAYER_NORM", False))


_SOFTMAX_KERNELS = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
                    "scaled_softmax_cuda")


def have_fused_softmax() -> bool:
    """Whether Megatron's CUDA softmax kernels import (FusedScaleMaskSoftmax needs all three)."""
    return all(importable(name) for name in _SOFTMAX_KERNELS)


def have_fused_rope() -> bool:
    """Whether megatron.core found Transformer Engine's fused RoPE (what the config checks)."""
    from megatron.core.models.common.embeddings import rope_utils

    return getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is not None or \
        getattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None) is not None


def _uses_rope(args) -> bool:
    return args.use_rotary_position_embeddings or \
        args.position_embedding_type in ("rope", "mrope", "yarn")


def portable_defaults(args, accelerator_name: str, note=None) -> list[str]:
    """Switch the settings this machine cannot run; returns the notes given (each also passed
    to `note`, the run's note sink, when given)."""
    notes = []
    if args.transformer_impl == "transformer_engine" and not have_transformer_engine():
        args.transformer_impl = "local"
        notes.append("npuspeed: Transformer Engine is not installed: using --transformer-impl local "
                     "(Megatron's own modules; npuspeed's feature flags apply to them)")
    if args.gradient_accumulation_fusion and args.transformer_impl != "transformer_engine" \
            and not have_grad_accum_fusion():
        args.gradient_accumulation_fusion = False
        notes.append("npuspeed: apex's fused_weight_gradient_mlp_cuda is not installed: using "
                     "--no-gradient-accumulation-fusion (weight grads accumulate in plain torch; "
                     "--gradient-accumulation-fusion runs npuspeed's own)")
    if not args.no_persist_layer_norm and not have_persist_layer_norm():
        args.no_persist_layer_norm = True
        notes.append("npuspeed: apex's persistent LayerNorm kernel is not installed: using "
                     "--no-persist-layer-norm (torch's LayerNorm refuses persist_layer_norm)")
    if args.apply_rope_fusion and not have_fused_rope():
        args.apply_rope_fusion = False  # without rope upstream turns it off anyway: no note
        if _uses_rope(args):
            notes.append("npuspeed: Transformer Engine's fused RoPE is not installed: using "
                         "--no-rope-fusion (Megatron's own RoPE; --use-fused-rotary-pos-emb "
                         "runs npuspeed's fused kernel there)")
    if args.masked_softmax_fusion and not have_fused_softmax():
        args.masked_softmax_fusion = False
        if args.fp16 or args.bf16:  # the kernels are tried only for 16-bit inputs
            notes.append("npuspeed: Megatron's fused softmax CUDA kernels are not installed: using "
                         "--no-masked-softmax-fusion (torch softmax; --use-flash-attn replaces "
                         "the whole core attention instead)")
    needs_connections = (args.tensor_model_parallel_size > 1 or args.context_parallel_size > 1) \
        and not (args.use_torch_fsdp2 or args.use_megatron_fsdp) \
        and not args.overlap_moe_expert_parallel_comm
    if for_device(accelerator_name).host_is_device() and needs_connections and _CONNECTIONS not in os.environ:
        os.environ[_CONNECTIONS] = "1"
        notes.append(f"npuspeed: {_CONNECTIONS}=1 set for TP/CP (the CPU runs collectives and "
                     "compute in one in-order queue, which is what the variable asks of a GPU)")
    for message in notes if note else ():
        note(message)
    return notes


def validate_args_wrapper(accelerator_name: str, note=None):
    """Wrapper for `megatron.training.arguments.validate_args`."""

    def wrap(validate_args):
        @functools.wraps(validate_args)
        def wrapped(args, defaults={}, *rest, **kwargs):
            portable_defaults(args, accelerator_name, note)
            return validate_args(args, defaults, *rest, **kwargs)

        return wrapped

    return wrap


def device_arch_version() -> int:
    """`megatron.training.utils.get_device_arch_version` off CUDA: no CUDA architecture.

    Upstream's answer gates only CUDA-specific tuning (the CUDA_DEVICE_MAX_CONNECTIONS check
    before Blackwell, high-priority FSDP streams from Blackwell on); 0 keeps the
    pre-Blackwell rules, whose one requirement the wrapper above meets."""
    return 0
