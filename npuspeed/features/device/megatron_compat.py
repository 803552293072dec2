"""Fixes for older megatron-core releases that break on any backend, not only off CUDA.

Each one is version-ranged to the releases that have the bug, so newer Megatron runs its
own code untouched (see `npuspeed report`):

- 0.12's `quantize_param_shard` raises "Invalid Transformer Engine version" whenever
  Transformer Engine is absent, even with no FP8 parameter to quantize, so the
  distributed optimizer's step fails; 0.13 returns early for an empty list, as here.
- 0.12's async checkpoint writer calls torch's private `_write_item` without the
  `serialization_format` argument that newer torch requires; 0.13 passes TORCH_SAVE
  when the signature asks for it, as here.
- every release's `CheckpointWithoutOutput.__init__(fp8=False)` sets `self.fp8 = fp8 is not
  None`, i.e. True for its own default, and its forward then calls Transformer Engine's
  `FP8GlobalStateManager`: without TE, `--recompute-modules layernorm` / `moe_act` (which
  build it with no argument) fail with a NameError. Without TE there is no FP8 to honour, so
  the flag is cleared after upstream's __init__ (with TE, upstream runs untouched).
- 0.15's `model_parallel_config.py` calls `warnings.warn` (EP > 1 with TP > 1 and no sequence
  parallelism) without importing `warnings`: a NameError where Megatron meant a warning. The
  module gets the name it forgot (0.16 imports it).
"""
from __future__ import annotations

import functools
import inspect
import warnings

from npuspeed.patching.versions import importable

_MC = "megatron.core"


def quantize_param_shard_without_fp8(fn):
    """Nothing to quantize is not an error, with or without Transformer Engine."""

    @functools.wraps(fn)
    def quantize_param_shard(model_params, *args, **kwargs):
        if len(model_params) == 0:
            return None
        return fn(model_params, *args, **kwargs)

    return quantize_param_shard


def write_item_with_format(fn):
    """Supply torch's `serialization_format` (TORCH_SAVE, what older torch always wrote)."""
    params = list(inspect.signature(fn).parameters)
    if "serialization_format" not in params:
        return fn
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    position = params.index("serialization_format")

    @functools.wraps(fn)
    def _write_item(*args, **kwargs):
        if len(args) <= position:
            kwargs.setdefault("serialization_format", SerializationFormat.TORCH_SAVE)
        return fn(*args, **kwargs)

    return _write_item


def checkpoint_without_fp8(init):
    """CheckpointWithoutOutput.__init__ where Transformer Engine is absent: never FP8."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.fp8 = False

    return __init__


def _have_te() -> bool:
    return importable("transformer_engine")


def register(registry, feature: str) -> None:
    if not _have_te():
        registry.register(f"{_MC}.tensor_parallel.random.CheckpointWithoutOutput.__init__",
                          wrapper=checkpoint_without_fp8, feature=feature, megatron=">=0.12")
    registry.register(f"{_MC}.fp8_utils.quantize_param_shard",
                      wrapper=quantize_param_shard_without_fp8, feature=feature, megatron="<0.13")
    registry.register(f"{_MC}.dist_checkpointing.strategies.filesystem_async._write_item",
                      wrapper=write_item_with_format, feature=feature, megatron="<0.13")
    registry.register(f"{_MC}.model_parallel_config.warnings", warnings, feature=feature,
                      megatron=">=0.15,<0.16", if_missing=True)
