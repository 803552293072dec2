"""Megatron-Core's local ColumnParallelLinear / RowParallelLinear on the chunked functions.

`forward` is wrapped: a layer whose linear has a tensor-parallel collective takes the
chunked path; one without any (MoE experts with explicit communication, a column layer
with `disable_grad_reduce` and no SP) has nothing to overlap and runs Megatron's own
forward. Everything around the linear (weight checks, bias handling, gather_output,
scatter of a non-parallel row input) follows Megatron's forward of the same versions.

Construction is checked too, so a configuration the chunked path cannot honour fails at
model build, naming the flag: tensor-parallel size 1, deferred embedding wgrad, and, via
`build_module`, a linear class that is not one of these two (Transformer Engine's, or a
subclass with its own forward).
"""
from __future__ import annotations

import functools
import inspect
import logging
import re
from dataclasses import dataclass

from npuspeed.features.base import FeatureError
from npuspeed.features.coc_overlap.comm import ChunkedEngine, Collectives
from npuspeed.features.coc_overlap.functions import ColumnLinear, LinearSpec, RowLinear
from npuspeed.features.coc_overlap.mc2 import Mc2Engine
from npuspeed.ops import npu

log = logging.getLogger("npuspeed")
FLAG = "--use-coc"
_LINEAR_NAME = re.compile(r"(Column|Row)ParallelLinear$")


@dataclass(frozen=True)
class Settings:
    n: int
    mc2: bool
    accelerator: object
    #: the run's note sink (ctx.note); None logs instead
    note: object = None


def tp_group(layer):
    """The layer's tensor-parallel group (an attribute from Megatron 0.13, global before)."""
    group = getattr(layer, "tp_group", None)
    if group is not None:
        return group
    from megatron.core import parallel_state as ps

    if getattr(layer, "is_expert", False):
        return ps.get_expert_tensor_parallel_group()
    return ps.get_tensor_model_parallel_group()


def use_mc2(settings: Settings) -> bool:
    acc = settings.accelerator
    return settings.mc2 and npu.of(acc) is not None and acc.has_mc2()


def make_engine(group, settings: Settings):
    chunked = ChunkedEngine(settings.n, Collectives(group, settings.accelerator), settings.note)
    if use_mc2(settings):
        return Mc2Engine(npu.of(settings.accelerator), chunked, group, settings.accelerator)
    return chunked


def _call_mapping(fn, tensor, group):
    """Megatron's mapping functions take `group=` from 0.13 on."""
    if "group" in inspect.signature(fn).parameters:
        return fn(tensor, group=group)
    return fn(tensor)


def _offloading(layer) -> bool:
    ctx = getattr(layer.config, "_cpu_offloading_context", None)
    return ctx is not None and getattr(ctx, "inside_context", False) is True


def column_forward_wrapper(settings: Settings):
    def wrapper(original):
        @functools.wraps(original)
        def forward(self, input_, weight=None, runtime_gather_output=None):
            group = tp_group(self)
            collective = self.sequence_parallel or self.allreduce_dgrad
            if self.explicit_expert_comm or not collective or group.size() == 1 or _offloading(self):
                return original(self, input_, weight, runtime_gather_output)
            if weight is None:
                if self.weight is None:
                    raise RuntimeError("weight was not supplied to ColumnParallelLinear forward pass "
                                       "and skip_weight_param_allocation is True.")
                weight = self.weight
            elif weight.shape != (self.output_size_per_partition, self.input_size):
                raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, not "
                                   f"{(self.output_size_per_partition, self.input_size)} as expected")
            spec = LinearSpec(make_engine(group, settings), bool(self.sequence_parallel),
                              bool(self.allreduce_dgrad), bool(self.gradient_accumulation_fusion))
            bias = self.bias if not self.skip_bias_add else None
            out2d = ColumnLinear.apply(input_.reshape(-1, input_.shape[-1]), weight, bias, spec)
            output = out2d.view(-1, *input_.shape[1:-1], out2d.shape[-1])
            gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
            if gather and getattr(self, "use_inference_optimized_all_gather", False) and not self.training:
                from megatron.core.tensor_parallel.inference_layers import (  # 0.18+
                    inference_all_gather_from_tensor_model_parallel_region as inference_gather,
                )

                output = inference_gather(output, group, self.config)
            elif gather:
                from megatron.core.tensor_parallel import mappings

                output = _call_mapping(mappings.gather_from_tensor_model_parallel_region, output, group)
            return output, (self.bias if self.skip_bias_add else None)

        return forward

    return wrapper


def row_forward_wrapper(settings: Settings):
    def wrapper(original):
        @functools.wraps(original)
        def forward(self, input_):
            group = tp_group(self)
            if self.explicit_expert_comm or group.size() == 1 or _offloading(self):
                return original(self, input_)
            if self.input_is_parallel:
                input_parallel = input_
            else:
                from megatron.core.tensor_parallel import mappings

                input_parallel = _call_mapping(mappings.scatter_to_tensor_model_parallel_region, input_, group)
            spec = LinearSpec(make_engine(group, settings), bool(self.sequence_parallel),
                              gradient_accumulation_fusion=bool(self.gradient_accumulation_fusion))
            out2d = RowLinear.apply(input_parallel.reshape(-1, input_parallel.shape[-1]), self.weight, spec)
            output_ = out2d.view(-1, *input_parallel.shape[1:-1], out2d.shape[-1])
            if self.skip_bias_add:
                return output_, self.bias
            return (output_ + self.bias if self.bias is not None else output_), None

        return forward

    return wrapper


def init_wrapper(kind: str, note=None):
    """After Megatron's __init__: refuse what the chunked path cannot do, at model build."""

    def wrapper(original):
        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            if getattr(self, "explicit_expert_comm", False):  # nothing to chunk in the linear
                (note or log.warning)(f"--use-coc: MoE expert {kind}s communicate outside the linear (token "
                      "dispatcher); they run Megatron's own forward")
                return
            if tp_group(self).size() == 1:
                raise FeatureError(
                    f"{FLAG} overlaps tensor-parallel communication, but this {kind} has "
                    "tensor-model-parallel size 1 (nothing to overlap); run with "
                    "--tensor-model-parallel-size > 1 or drop --use-coc --coc-parallel-num")
            if getattr(self, "gtp_remat_size", 1) > 1:  # megatron-core 0.19
                raise FeatureError(
                    f"{FLAG} cannot chunk a {kind} whose weight is sharded for GTP rematerialisation "
                    f"(gtp_remat_size {self.gtp_remat_size}, megatron-core 0.19's "
                    "--tensor-parallel-num-weight-shards); drop one of the two")
            if getattr(self.config, "defer_embedding_wgrad_compute", False) and kind == "ColumnParallelLinear":
                raise FeatureError(
                    f"{FLAG} cannot replace a ColumnParallelLinear whose weight gradient is deferred "
                    "(defer_embedding_wgrad_compute); turn that off or drop --use-coc")

        return __init__

    return wrapper


def check_linear_class(cls) -> None:
    """Raise for a tensor-parallel linear class the chunked path would silently not cover."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if not isinstance(cls, type):
        return
    for base in (ColumnParallelLinear, RowParallelLinear):
        if issubclass(cls, base):
            owner = next(k for k in cls.__mro__ if "forward" in vars(k))
            if owner is not base:
                raise FeatureError(
                    f"{FLAG} replaces the forward of Megatron's {base.__name__}, but "
                    f"{cls.__module__}.{cls.__name__} defines its own forward; use the local "
                    "layer or drop --use-coc")
            return
    if _LINEAR_NAME.search(cls.__name__):
        raise FeatureError(
            f"{FLAG} replaces Megatron-Core's local ColumnParallelLinear/RowParallelLinear only; "
            f"this model builds {cls.__module__}.{cls.__name__} (e.g. Transformer Engine's). Use "
            "the local spec (--transformer-impl local) or drop --use-coc")


def build_module_wrapper(original):
    @functools.wraps(original)
    def build_module(spec_or_module, *args, **kwargs):
        cls = spec_or_module if isinstance(spec_or_module, type) else getattr(spec_or_module, "module", None)
        check_linear_class(cls)
        return original(spec_or_module, *args, **kwargs)

    return build_module
