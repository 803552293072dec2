"""--use-fused-swiglu: the SwiGLU activation of Megatron's MLP runs the fused op.

MLP.forward reaches SwiGLU in two ways: with `config.bias_activation_fusion` (Megatron-LM's
default under `--swiglu`) it calls `fused_bias_swiglu.bias_swiglu_impl`, which we wrap; without
it, it runs an inline closure no patch can reach. So for gated-silu MLPs built without the
fusion we give the MLP (only it) a copy of its config with `bias_activation_fusion=True`,
which routes it to the wrapped function; the maths is the same SwiGLU. Configurations the
fused op does not cover (clamped or offset GLU, TE activations) are left untouched, and so
are calls with Megatron's fp8/offload input-store options (they run Megatron's own kernel).
"""
from __future__ import annotations

import copy
import functools

import torch.nn.functional as F

from npuspeed import telemetry
from npuspeed.ops.swiglu import fused_swiglu, swiglu_reference

BIAS_SWIGLU = "megatron.core.fusions.fused_bias_swiglu.bias_swiglu_impl"
MLP_INIT = "megatron.core.transformer.mlp.MLP.__init__"
#: counter: MLPs routed to the fused activation in this process
ROUTED = "swiglu.routed"
#: what the flag needs, for the error when a built block has no such MLP
NEEDS = "needs a gated SiLU MLP (--swiglu) built by Megatron's local spec"


def fused_bias_swiglu(original):
    @functools.wraps(original)
    def bias_swiglu_impl(input, bias, *options, **kw_options):
        # fp8_input_store (0.12+), cpu_offload_input (later): any that is set keeps Megatron's.
        if any(options) or any(kw_options.values()):
            return original(input, bias, *options, **kw_options)
        # the flag off runs one of these two: the MLP's eager closure, or this function
        megatron = {"megatron": swiglu_reference}
        if input.dim() in (2, 3):
            megatron["megatron_fused"] = lambda x: original(x, None)
        return fused_swiglu(input if bias is None else input + bias, megatron)

    return bias_swiglu_impl


def _routable(config) -> bool:
    return (
        getattr(config, "gated_linear_unit", False)
        and getattr(config, "activation_func", None) is F.silu
        and not getattr(config, "bias_activation_fusion", False)
        and not getattr(config, "use_te_activation_func", False)
        and getattr(config, "activation_func_clamp_value", None) is None
        and not getattr(config, "glu_linear_offset", 0.0)
    )


def route_mlp(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if _routable(self.config) and getattr(self, "activation_func", F.silu) is F.silu:
            fused = copy.copy(self.config)
            object.__setattr__(fused, "bias_activation_fusion", True)
            self.config = fused
            telemetry.count(ROUTED)

    return __init__


def _fused_swiglu_mlp(module) -> bool:
    """An MLP whose forward reaches bias_swiglu_impl (routed here, or fused by its config)."""
    from megatron.core.transformer.mlp import MLP

    config = getattr(module, "config", None)
    return (isinstance(module, MLP) and getattr(config, "gated_linear_unit", False)
            and getattr(config, "bias_activation_fusion", False)
            and getattr(module, "activation_func", getattr(config, "activation_func", None)) is F.silu)


def acts_in(block) -> bool:
    return any(_fused_swiglu_mlp(m) for m in block.modules())


def found_in(block) -> str:
    config = block.config
    act = getattr(getattr(config, "activation_func", None), "__name__", "?")
    return f"gated_linear_unit={getattr(config, 'gated_linear_unit', '?')}, activation={act}"

