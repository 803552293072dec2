"""Optimizer state in one on-disk form for every layout and optimizer kind.

megatron.core's optimizers describe their state as ShardedTensors keyed by the model
parameter they belong to (`optimizer.state.exp_avg.<param key>`), so TP and PP changes
reshard like the model. Two things still tie a checkpoint to the run that wrote it:
- the distributed optimizer's default formats are flat per-DP-rank buffers; its
  `fully_reshardable` format is per parameter too, but names the fp32 master `param` where
  the ordinary mixed-precision optimizer says `fp32_param` (fp32 runs have no master: the
  parameter is its own);
- everything that is not a tensor (param_groups, the step, the loss scaler) is stored as
  the saving optimizer's nested dict, which a different kind or layout cannot merge.
So only the tensors are saved, under one naming (`fp32_param`), plus the step and the loss
scaler as plain values; a load asks the *current* optimizer for its own template, fills
its tensors by key and restores the step. TP2+SP -> TP1, TP1 -> PP2 and DP2 with the
distributed optimizer -> DP1 without it all read the same files.
"""
from __future__ import annotations

import dataclasses

import torch
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

_FULL = {"distrib_optim_sharding_type": "fully_reshardable"}
_MASTER = "optimizer.state.param."
_CANON = "optimizer.state.fp32_param."


def _subs(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def kind(optimizer) -> str:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return "distributed" if any(isinstance(o, DistributedOptimizer) for o in _subs(optimizer)) else "plain"


def _map(tree, fn):
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map(v, fn) for v in tree]
    return fn(tree)


def _canonical(leaf):
    if isinstance(leaf, ShardedBase) and leaf.key.startswith(_MASTER):
        return dataclasses.replace(leaf, key=_CANON + leaf.key[len(_MASTER):])
    return leaf


def _template(optimizer, model_sd, loading: bool):
    native = optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=dict(_FULL))
    return _map(native, _canonical)


def leaves(tree) -> list:
    """The sharded leaves in traversal order (one key may have many: layers stack on axis 0)."""
    out = []
    _map(tree, lambda leaf: out.append(leaf) if isinstance(leaf, ShardedBase) else None)
    return out


def _inner_states(optimizer):
    for sub in _subs(optimizer):
        inner = getattr(sub, "optimizer", None)
        if inner is not None:
            yield from inner.state.values()


def _step(optimizer) -> int | None:
    steps = {int(s["step"]) for s in _inner_states(optimizer) if "step" in s}
    return max(steps) if steps else None


def _scalers(optimizer) -> list:
    return [sub.grad_scaler.state_dict() if getattr(sub, "grad_scaler", None) is not None else None
            for sub in _subs(optimizer)]


def to_save(optimizer, model_sd) -> dict:
    """What the checkpoint holds for the optimizer: tensors by key, step and loss scalers."""
    return {"tensors": leaves(_template(optimizer, model_sd, loading=False)),
            "step": _step(optimizer), "grad_scalers": _scalers(optimizer), "kind": kind(optimizer)}


def load_request(optimizer, model_sd, saved_keys: set):
    """(template, request list, substitutes) for a load. A master the checkpoint lacks (saved
    by an fp32 run, whose parameters were their own masters) is not requested again (one key
    cannot be read twice in one load): `substitutes` holds its (model key, offset), filled from
    the loaded model weight by `restore`."""
    template = _template(optimizer, model_sd, loading=True)
    request, substitutes = [], {}
    for i, leaf in enumerate(leaves(template)):
        key = leaf.key
        if key not in saved_keys and key.startswith(_CANON) and key[len(_CANON):] in saved_keys:
            substitutes[i] = (key[len(_CANON):], getattr(leaf, "global_offset", None))
            continue
        request.append(leaf)
    return template, request, substitutes


def model_tensors(model_template, loaded) -> dict:
    """(key, global offset) -> loaded tensor, walking the model template and its loaded state."""
    out = {}

    def walk(t, v):
        if isinstance(t, dict):
            for k in t:
                walk(t[k], v[k])
        elif isinstance(t, list):
            for a, b in zip(t, v):
                walk(a, b)
        elif isinstance(t, ShardedBase):
            out[(t.key, getattr(t, "global_offset", None))] = v

    walk(model_template, loaded)
    return out


def missing(request: list, saved_keys: set) -> list[str]:
    return sorted({leaf.key for leaf in request if leaf.key not in saved_keys})


def _set_step(tree, step: int) -> None:
    """Write the saved step where each kind keeps it in its state dict: the distributed
    optimizer in every param group, the others as `state['common_step']`."""
    if isinstance(tree, dict):
        groups = tree.get("param_groups")
        if isinstance(groups, list) and groups and isinstance(groups[0], dict):
            # megatron-core 0.14's plain optimizer lists "step": None in its groups (the step is the
            # per-parameter state's, saved as common_step): only a group holding one keeps it there
            if all("step" in g for g in groups) and any(g["step"] is not None for g in groups):
                for group in groups:
                    old = group["step"]
                    if old is not None:
                        group["step"] = torch.full_like(old, step) if torch.is_tensor(old) else type(old)(step)
            elif isinstance(tree.get("state"), dict):
                tree["state"]["common_step"] = torch.tensor(float(step))
            return
        for value in tree.values():
            _set_step(value, step)
    elif isinstance(tree, list):
        for value in tree:
            _set_step(value, step)


def restore(optimizer, template, loaded: list, saved: dict, substitutes=None, model=None) -> None:
    """Fill the current optimizer's own state dict with the loaded tensors (the request's order)
    and the substituted masters (from `model`, see model_tensors); restore step and scalers."""
    values, index = iter(loaded), iter(range(10**12))
    substitutes = substitutes or {}

    def fill(leaf):
        if isinstance(leaf, ShardedBase):
            i = next(index)
            return model[substitutes[i]].clone() if i in substitutes else next(values)
        if isinstance(leaf, LocalNonpersistentObject):
            return leaf.unwrap()
        return leaf

    filled = _map(template, fill)
    if saved.get("step") is not None:
        _set_step(filled, saved["step"])
    optimizer.load_state_dict(filled)
    for sub, scaler in zip(_subs(optimizer), saved.get("grad_scalers") or []):
        if scaler is not None and getattr(sub, "grad_scaler", None) is not None:
            sub.grad_scaler.load_state_dict(scaler)
