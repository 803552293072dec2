"""Megatron's optimizer methods that read or write fp32 masters or optimizer states outside a step.

Features that keep masters or states somewhere other than plain device tensors
(`--reuse-fp32-param` inside the bf16 params, `--swap-optimizer` in host memory) bring them
back before these run: checkpoint state dicts, loads, reloading the masters from the model.
One list, with the megatron-core versions that have each method, so both features see a
method Megatron adds once it is added here.
"""
from __future__ import annotations

import functools

OPT = "megatron.core.optimizer"

_MIXED = ["state_dict", "sharded_state_dict", "load_state_dict", "_copy_model_params_to_main_params"]
#: classes that hold fp32 masters -> their methods that read or write masters or states
MASTER_ACCESS = {
    "optimizer.Float16OptimizerWithFloat16Params": _MIXED,
    "distrib_optimizer.DistributedOptimizer": _MIXED + [
        "get_parameter_state_dp_zero", "get_parameter_state_dp_reshardable",
        "load_parameter_state_from_dp_zero", "load_parameter_state_from_dp_reshardable",
        "load_parameter_state_from_fs_model_space", "load_parameter_state_from_fully_reshardable",
        # 0.19: copies the fp32 master shards into the param buffer before an explicit param sync
        "prepare_model_params_for_param_sync",
    ],
}
#: fp32 runs: states, no masters
STATE_ONLY_ACCESS = {"optimizer.FP32Optimizer": ["state_dict", "sharded_state_dict", "load_state_dict"]}
#: methods present only in newer megatron-core
SINCE = {"get_parameter_state_dp_reshardable": ">=0.15", "load_parameter_state_from_dp_reshardable": ">=0.15",
         "load_parameter_state_from_fully_reshardable": ">=0.15",
         "load_parameter_state_from_fs_model_space": ">=0.12",
         "prepare_model_params_for_param_sync": ">=0.19"}


def materializing(attr: str):
    """Wrapper factory: before the method runs, `self.<attr>.materialize()` where the feature
    attached one to this optimizer."""

    def wrap(method):
        @functools.wraps(method)
        def wrapped(self, *args, **kwargs):
            holder = getattr(self, attr, None)
            if holder is not None:
                holder.materialize()
            return method(self, *args, **kwargs)

        return wrapped

    return wrap


def register_materializing(registry, feature: str, attr: str, classes: dict) -> None:
    """Wrap every method of `classes` (class -> method names) with `materializing(attr)`."""
    wrapper = materializing(attr)
    for cls, methods in classes.items():
        for name in methods:
            registry.register(f"{OPT}.{cls}.{name}", wrapper=wrapper, feature=feature,
                              megatron=SINCE.get(name, ">=0.12"))
