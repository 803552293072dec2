"""Three bugs of megatron.core's DistributedOptimizer on the path without apex/TE (0.16).

They hit GPUs as much as CPUs and NPUs (any run with torch's own Adam), with megatron.core
alone (the example's `--load`) as with Megatron-LM, so the device feature applies them. Each fix is a wrapper, so upstream's code still does the work.

1. `DistributedOptimizer.state_dict` (distrib_optimizer.py:640) takes the step count from
   torch Adam's per-parameter state and asserts there is exactly one value. While building
   the template a `--load` fills in, no step has run: the state is empty (or holds moments
   but no `step`), and the assertion fails. The wrapper lends the state a step count of 0
   for the call (what it would read had the count been kept from the start) and takes it
   back afterwards, so the optimizer itself is unchanged.
2. `load_parameter_state_from_dp_reshardable` (:1772) copies loaded values into views of
   the fp32 main params, which are leaves requiring grad, without the `torch.no_grad()` its
   siblings have (:1806); in fp32 the copy raises. The wrapper adds it.
3. The step count after a `--load` (distrib_optimizer.py:817-825 and 911-940). Upstream
   restores it from the param groups, but (a) gives every parameter's state the SAME `step`
   tensor, which torch's Adam increments in place once per parameter, and (b) then copies
   the parameter state in, `step` included, from the load template, where it is a
   non-persistent placeholder (so the restored count is overwritten with the template's).
   Training resumes, but Adam's bias correction uses a wrong step (measured: DP2 with the
   distributed optimizer, losses differ from the second step after the resume). The
   wrappers keep the count that came from the param groups and give each parameter its
   own copy. (c) The `fully_reshardable` load (:2100) leaves `step` out of the tensors it
   passes while the state holds one, and the copy loop raises KeyError('step'): the same
   wrapper supplies the current count there.
"""
from __future__ import annotations

import contextlib
import functools
import sys

import torch

from npuspeed.patching.wrappers import followed_by, within

DISTRIB = "megatron.core.optimizer.distrib_optimizer"


def _uses_torch_step_state(optimizer) -> bool:
    module = sys.modules.get(DISTRIB)
    return module is not None and not getattr(module, "HAVE_APEX_OR_TE", True) \
        and isinstance(optimizer, torch.optim.Optimizer)


@contextlib.contextmanager
def lent_step_count(inner: torch.optim.Optimizer):
    """If no parameter state carries a step count, lend the first parameter one of 0."""
    state = inner.state
    has_step = any("step" in s for s in state.values())
    params = [p for group in inner.param_groups for p in group["params"]]
    if has_step or not params:
        yield
        return
    param = params[0]
    created = param not in state or len(state[param]) == 0
    lent = {}
    # Parameters with moments but no step count would trip upstream's s["step"] too.
    for p, s in list(state.items()):
        if len(s) and "step" not in s:
            s["step"] = lent[p] = torch.zeros((), dtype=torch.float32)
    if created:
        state[param]["step"] = lent[param] = torch.zeros((), dtype=torch.float32)
    try:
        yield
    finally:
        for p in lent:
            state[p].pop("step", None)
            if not state[p]:
                del state[p]


def state_dict_before_first_step(state_dict):
    """Wrapper for DistributedOptimizer.state_dict (fix 1)."""

    @functools.wraps(state_dict)
    def wrapped(self, *args, **kwargs):
        inner = getattr(self, "optimizer", None)
        if not _uses_torch_step_state(inner):
            return state_dict(self, *args, **kwargs)
        with lent_step_count(inner):
            return state_dict(self, *args, **kwargs)

    return wrapped


def own_step_counts(optimizer: torch.optim.Optimizer) -> int:
    """Give each parameter state its own `step` tensor; returns how many were shared."""
    seen, unshared = set(), 0
    for state in optimizer.state.values():
        step = state.get("step")
        if torch.is_tensor(step):
            if id(step) in seen:
                state["step"] = step.detach().clone()
                unshared += 1
            seen.add(id(step))
    return unshared


def _own_steps_after_load(optimizer, _result) -> None:
    inner = getattr(optimizer, "optimizer", None)
    if _uses_torch_step_state(inner):
        own_step_counts(inner)


#: Wrapper for DistributedOptimizer.load_state_dict (fix 3a).
load_state_dict_own_steps = followed_by(_own_steps_after_load)


def keep_step_count(set_states):
    """Wrapper for DistributedOptimizer._set_main_param_and_optimizer_states (fix 3b)."""

    @functools.wraps(set_states)
    def wrapped(self, model_param, tensors, *args, **kwargs):
        inner = getattr(self, "optimizer", None)
        if _uses_torch_step_state(inner) and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = inner.param_groups[group_index]["params"][group_order]
            current = inner.state[main_param].get("step")
            if torch.is_tensor(current):
                tensors = {**tensors, "step": current.detach().clone()}
        return set_states(self, model_param, tensors, *args, **kwargs)

    return wrapped


#: Wrapper for load_parameter_state_from_dp_reshardable (fix 2).
under_no_grad = within(torch.no_grad)


def register(registry, feature: str, megatron_range: str) -> None:
    cls = f"{DISTRIB}.DistributedOptimizer"
    registry.register(f"{cls}.state_dict", wrapper=state_dict_before_first_step,
                      feature=feature, megatron=megatron_range)
    registry.register(f"{cls}.load_state_dict", wrapper=load_state_dict_own_steps,
                      feature=feature, megatron=megatron_range)
    registry.register(f"{cls}._set_main_param_and_optimizer_states", wrapper=keep_step_count,
                      feature=feature, megatron=megatron_range)
    registry.register(f"{cls}.load_parameter_state_from_dp_reshardable", wrapper=under_no_grad,
                      feature=feature, megatron=megatron_range)
