"""The fp8 feature's two patches: TransformerLayer.forward marks which layer runs (layers.py), and
Megatron's tensor-parallel linear function (what ColumnParallelLinear and RowParallelLinear call,
experts' too) runs the FP8 linear (tp_linear.py) inside an FP8 layer, Megatron's own elsewhere."""
from __future__ import annotations

import functools
import inspect

from npuspeed import telemetry

LAYER_FORWARD = "megatron.core.transformer.transformer_layer.TransformerLayer.forward"
TP_LINEAR = "megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce"
PREFIX = "fp8."
STATE_ATTR = "_npuspeed_fp8_state"


def _count(name: str, n: int) -> None:
    telemetry.count(PREFIX + name, n)


def _state(weight, recipe):
    """The delayed recipe's per-linear scalers, kept on the weight (one linear, one weight)."""
    state = weight.__dict__.get(STATE_ATTR)
    if state is None:
        state = recipe.new_state()
        weight.__dict__[STATE_ATTR] = state
    return state


def fp8_tp_linear(recipe, config):
    """Wrapper of Megatron's linear function: FP8 inside an FP8 layer, the original elsewhere."""
    from npuspeed.features.fp8.layers import bf16_layer, current_layer
    from npuspeed.features.fp8.tp_linear import Fp8TensorParallelLinear

    def wrap(original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def linear(*args, **kwargs):
            here = current_layer()
            if here is None:
                return original(*args, **kwargs)
            layer_no, layer_config = here
            if bf16_layer(layer_no, layer_config.num_layers, config):
                _count("bf16_layer_linears", 1)
                return original(*args, **kwargs)
            a = signature.bind(*args, **kwargs)
            a.apply_defaults()
            a = a.arguments
            if a.get("grad_output_buffer") is not None:
                # deferred weight gradients (--defer-embedding-wgrad-compute) are the output
                # layer's, which is outside every layer; inside one, keep Megatron's path
                _count("deferred_wgrad_linears", 1)
                return original(*args, **kwargs)
            group = a.get("tp_group")
            if group is None:
                from megatron.core import parallel_state

                group = parallel_state.get_tensor_model_parallel_group()
            allreduce_dgrad = a.get("allreduce_dgrad")
            if allreduce_dgrad is None:
                allreduce_dgrad = bool(a.get("async_grad_allreduce"))
            weight = a["weight"]
            return Fp8TensorParallelLinear.apply(
                a["input"], weight, a["bias"], a["gradient_accumulation_fusion"], allreduce_dgrad,
                a["sequence_parallel"], group, recipe, _state(weight, recipe), _count)
        return linear
    return wrap


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.features.fp8.layers import layer_forward

    recipe = config.recipe()
    registry.register(LAYER_FORWARD, wrapper=layer_forward, feature=feature, megatron=">=0.12")
    registry.register(TP_LINEAR, wrapper=fp8_tp_linear(recipe, config), feature=feature, megatron=">=0.12")
