"""Where the shared masters plug into Megatron's mixed-precision optimizers.

After each optimizer is built its masters are handed to a SharedMasters and released.
Every method that reads or writes main parameters first materializes them; the step
releases them again once Megatron has copied the new values into the bf16 parameters.
"""
from __future__ import annotations

import functools

from npuspeed.features.base import FeatureError
from npuspeed.features.optimizer_state_access import MASTER_ACCESS, register_materializing
from npuspeed.features.reuse_fp32_param.shared_masters import SharedMasters

_OPT = "megatron.core.optimizer"
ATTR = "_npuspeed_shared_masters"


def _attach(self, pairs) -> None:
    if getattr(self.config, "fp16", False):
        raise FeatureError("--reuse-fp32-param works with --bf16 only; drop --fp16 or the flag")
    pairs = [(model, main) for model, main in pairs if model is not None]
    if not pairs:
        return
    shared = SharedMasters(pairs)
    shared.release()
    setattr(self, ATTR, shared)


def float16_init(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if not self.is_stub_optimizer:
            _attach(self, [(m, p) for mg, pg in zip(self.float16_groups, self.fp32_from_float16_groups)
                           for m, p in zip(mg, pg)])

    return __init__


def distributed_init(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if not self.is_stub_optimizer:
            _attach(self, [(m, p) for mg, pg in zip(self.shard_float16_groups,
                                                     self.shard_fp32_from_float16_groups)
                           for m, p in zip(mg, pg)])

    return __init__


def fp32_init(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        raise FeatureError(
            "--reuse-fp32-param shares the fp32 master weights with bf16 parameters, but this run "
            "trains in fp32 (no master copies exist); add --bf16 or drop --reuse-fp32-param"
        )

    return __init__


def stepped(method):
    """Wrapper for step_with_ready_grads: materialize, step, release."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        shared = getattr(self, ATTR, None)
        if shared is None:
            return method(self, *args, **kwargs)
        shared.materialize()
        result = method(self, *args, **kwargs)
        shared.release()
        return result

    return wrapped


def register(registry, ctx, config, feature: str) -> None:
    """The four optimizer patches and the materializing readers (the flag has no settings)."""
    registry.register(f"{_OPT}.optimizer.Float16OptimizerWithFloat16Params.__init__",
                      wrapper=float16_init, feature=feature)
    registry.register(f"{_OPT}.distrib_optimizer.DistributedOptimizer.__init__",
                      wrapper=distributed_init, feature=feature)
    registry.register(f"{_OPT}.optimizer.FP32Optimizer.__init__", wrapper=fp32_init, feature=feature)
    registry.register(f"{_OPT}.optimizer.MixedPrecisionOptimizer.step_with_ready_grads",
                      wrapper=stepped, feature=feature)
    register_materializing(registry, feature, ATTR, MASTER_ACCESS)
