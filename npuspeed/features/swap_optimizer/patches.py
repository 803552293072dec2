"""Where the swap plugs into Megatron's optimizers (mixed precision, distributed, fp32, chained).

After an optimizer is built, an OptimizerSwap takes its inner torch optimizer (swapper.py) and
sends masters and states to the host. Megatron's step_with_ready_grads marks the swap active,
so the inner `step()` it calls runs by chunks; after each chunk's update Megatron's own
`_copy_main_params_to_model_params` runs restricted to that chunk (its group lists cut down for
the call), while the masters are on the device, and the full copy Megatron makes after the
inner step is then skipped. Every method that reads or writes masters or states outside the
step (state dicts, loads, reloading masters from the model) first brings everything in.
"""
from __future__ import annotations

import contextlib
import functools

from npuspeed.features.base import FeatureError
from npuspeed.features.optimizer_state_access import MASTER_ACCESS, STATE_ONLY_ACCESS, register_materializing
from npuspeed.features.swap_optimizer.swapper import PREFIX, OptimizerSwap

_OPT = "megatron.core.optimizer"
ATTR = "_npuspeed_swap_optimizer"
FLAG = "--swap-optimizer"

#: (model group attribute, main group attribute) pairs the main->model copy walks, per class
_COPY_GROUPS = {
    "Float16OptimizerWithFloat16Params": [("float16_groups", "fp32_from_float16_groups")],
    "DistributedOptimizer": [("model_float16_groups", "shard_fp32_from_float16_groups"),
                             ("model_fp32_groups", "shard_fp32_groups")],
}
#: the group attribute holding fp32 masters (copies of bf16/fp16 weights), per class
_MASTERS = {"Float16OptimizerWithFloat16Params": "fp32_from_float16_groups",
            "DistributedOptimizer": "shard_fp32_from_float16_groups"}


def _class_key(opt) -> str | None:
    for cls in type(opt).__mro__:
        if cls.__name__ in _COPY_GROUPS:
            return cls.__name__
    return None


@contextlib.contextmanager
def _restricted(opt, params):
    """Megatron's group lists of `opt` cut down to the pairs whose main param is in `params`."""
    keep = {id(p) for p in params}
    saved = {}
    try:
        for model_attr, main_attr in _COPY_GROUPS[_class_key(opt)]:
            models, mains = getattr(opt, model_attr), getattr(opt, main_attr)
            saved[model_attr], saved[main_attr] = models, mains
            pairs = [[(m, p) for m, p in zip(mg, pg) if id(p) in keep] for mg, pg in zip(models, mains)]
            setattr(opt, model_attr, [[m for m, _ in g] for g in pairs])
            setattr(opt, main_attr, [[p for _, p in g] for g in pairs])
        yield
    finally:
        for attr, value in saved.items():
            setattr(opt, attr, value)


def _has_fp8_params(opt) -> bool:
    try:
        from megatron.core.fp8_utils import is_float8tensor
    except ImportError:
        return False
    groups = getattr(opt, "model_float16_groups", None) or getattr(opt, "float16_groups", None) or []
    return any(is_float8tensor(p) for group in groups for p in group)


def _check(opt) -> None:
    config = opt.config
    if getattr(config, "use_precision_aware_optimizer", False):
        raise FeatureError(f"{FLAG} with --use-precision-aware-optimizer: Transformer Engine's fused Adam keeps "
                           f"masters and states in its own layout, which the swap does not move; drop one of them")
    if getattr(config, "optimizer_cpu_offload", False):
        raise FeatureError(f"{FLAG} with --optimizer-cpu-offload: both move optimizer state to the host; pick one "
                           f"(drop --optimizer-cpu-offload to keep {FLAG})")
    if getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False) or _has_fp8_params(opt):
        raise FeatureError(f"{FLAG} with fp8 parameters: their masters are quantized for all parameters at once, "
                           "not per chunk; drop --fp8-param-gather or the flag")
    ddp = getattr(opt, "ddp_config", None)
    if ddp is not None and getattr(ddp, "use_megatron_fsdp", False):
        raise FeatureError(f"{FLAG} with Megatron FSDP: its buffers own the optimizer's masters; drop one of them")


def attach(opt, accelerator, chunk_bytes: int, swap_masters: bool, sizer=None) -> OptimizerSwap | None:
    """Put `opt`'s (a Megatron optimizer's) states and masters on the host."""
    inner = getattr(opt, "optimizer", None)
    if inner is None or getattr(opt, "is_stub_optimizer", False) or getattr(opt, ATTR, None) is not None:
        return getattr(opt, ATTR, None)
    _check(opt)
    key = _class_key(opt)
    masters = []
    if swap_masters and key is not None:
        masters = [p for group in getattr(opt, _MASTERS[key]) for p in group]

    def after_update(params):
        with _restricted(opt, params):
            opt._copy_main_params_to_model_params()

    swap = OptimizerSwap(accelerator, inner, masters, chunk_bytes, after_update if key is not None else None,
                         sizer=sizer() if sizer is not None else None)
    setattr(opt, ATTR, swap)
    swap.release()
    return swap


def built(accelerator, chunk_bytes: int, swap_masters: bool, sizer=None):
    """Wrapper for a Megatron optimizer's __init__: attach the swap once it is built (`sizer`:
    makes each swap's sizer.ChunkSizer)."""

    def wrap(init):
        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            attach(self, accelerator, chunk_bytes, swap_masters, sizer)

        return __init__

    return wrap


def stepping(method):
    """Wrapper for step_with_ready_grads: the inner step it makes runs by chunks."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        swap = getattr(self, ATTR, None)
        if swap is None or swap.in_step:
            return method(self, *args, **kwargs)
        swap.in_step, swap.copied = True, False
        try:
            return method(self, *args, **kwargs)
        finally:
            swap.in_step, swap.copied = False, False

    return wrapped


def copying(method):
    """Wrapper for _copy_main_params_to_model_params: already done chunk by chunk in a swapped
    step (skipped then); elsewhere the masters are brought in first."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        swap = getattr(self, ATTR, None)
        if swap is not None and swap.in_step and swap.copied:
            from npuspeed import telemetry

            telemetry.count(PREFIX + "copies_skipped")
            return None
        if swap is not None and not swap.in_step:
            swap.materialize()
        return method(self, *args, **kwargs)

    return wrapped


def register(registry, ctx, config, feature: str) -> None:
    """Nothing with Megatron's own --optimizer-cpu-offload, or where the states stay in place
    (the host is the device: feature.idle_reason says so)."""
    from npuspeed.accelerator import host_link
    from npuspeed.features.swap_optimizer.policy import chunk_bytes, moves, parse_mode
    from npuspeed.features.swap_optimizer.sizer import ChunkSizer

    if not config.swap_optimizer or not moves(ctx.accelerator):
        return
    acc, mode = ctx.accelerator, parse_mode(config.swap_optimizer_mode)
    init = built(acc, chunk_bytes(config), swap_masters=not config.reuse_fp32_param,
                 sizer=lambda: ChunkSizer(acc, mode, lambda: host_link.link(acc), ctx.note))
    for cls in ("optimizer.Float16OptimizerWithFloat16Params", "optimizer.FP32Optimizer",
                "distrib_optimizer.DistributedOptimizer"):
        registry.register(f"{_OPT}.{cls}.__init__", wrapper=init, feature=feature)
    for cls in ("optimizer.MixedPrecisionOptimizer", "optimizer.FP32Optimizer"):
        registry.register(f"{_OPT}.{cls}.step_with_ready_grads", wrapper=stepping, feature=feature)
    for cls in ("optimizer.Float16OptimizerWithFloat16Params", "distrib_optimizer.DistributedOptimizer"):
        registry.register(f"{_OPT}.{cls}._copy_main_params_to_model_params", wrapper=copying, feature=feature)
    register_materializing(registry, feature, ATTR, {**MASTER_ACCESS, **STATE_ONLY_ACCESS})
