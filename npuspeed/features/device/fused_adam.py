"""torch's fused Adam where megatron-core falls back to torch's Adam (no Transformer Engine, no apex).

Without TE and apex, megatron-core builds torch's own optimizer with lr, weight_decay, betas and
eps only: 0.12-0.14 call `torch.optim.AdamW` (bound as `Adam` at import), 0.15-0.19
`torch.optim.AdamW`, or `torch.optim.Adam` with `decoupled_weight_decay=False`. Neither
`fused` nor `foreach` is passed, so torch runs its for-loop where the parameters live on the
CPU and its foreach path on CUDA / NPU. torch's fused kernel (`fused=True`) does the same
update in one pass over each tensor: on CPU several times faster (docs/features/device.md has
the figure), on CUDA torch's documented order is fused > foreach > for-loop.

`adopt` turns an optimizer Megatron just built into the fused one, exactly what the
constructor does with `fused=True` (every param group's `fused`, `defaults`, and
`_step_supports_amp_scaling`), where every parameter can take the kernel: a plain tensor,
floating point, contiguous (the CPU kernel walks a parameter and its gradient as flat arrays),
on a device with the kernel (`DeviceTraits.has_fused_adam`). Elsewhere Megatron's optimizer is
left as built and the reason is logged once. The patch wraps
`_get_megatron_optimizer_based_on_param_groups` (one name in 0.12-0.19), after Megatron's mixed
precision and distributed wrappers are built, so their param groups are the ones changed.

Three hooks on the optimizer keep the choice for the whole run and out of checkpoints: its
state dict leaves `fused` unset in the param groups, as Megatron built them (a checkpoint loads
in a run without npuspeed, or on a device without the kernel, as one of Megatron's own); a
checkpoint's param groups replace the optimizer's on a load, so a load_state_dict post hook sets
`fused` again and gives each `step` count the fused kernel's form (fp32 on the parameter's
device, as torch's own load does for a fused group); and a step pre
hook checks the gradients' layout (the kernel reads them as flat arrays too) and, should one not
match its parameter, goes back to torch's unfused update for the rest of the run, saying so.
"""
from __future__ import annotations

import functools
import logging

import torch

from npuspeed import telemetry
from npuspeed.accelerator.devices import for_device

log = logging.getLogger("npuspeed")

TARGET = "megatron.core.optimizer._get_megatron_optimizer_based_on_param_groups"
#: counters: optimizer steps taken by the fused kernel; optimizers built fused / left as built
STEPS, FUSED, KEPT = "adam.fused_steps", "adam.fused_optimizers", "adam.megatron_optimizers"
ATTR = "_npuspeed_fused_adam"
MODES = ("auto", "megatron")

#: one record per torch Adam/AdamW megatron-core built in this process (the report, the summary)
_BUILT: list[dict] = []


def describe(cls_name: str, fused: bool, device_type: str) -> str:
    """The implementation in words: 'torch AdamW fused=True' or Megatron's default on a device."""
    if fused:
        return f"torch {cls_name} fused=True"
    default = "for-loop" if for_device(device_type).host_is_device() else "foreach"
    return f"torch {cls_name} (Megatron's default: {default})"


def _torch_adam(opt) -> str | None:
    """'Adam' / 'AdamW' for torch's own classes (not a subclass, not TE's or apex's FusedAdam)."""
    if type(opt) is torch.optim.AdamW:
        return "AdamW"
    if type(opt) is torch.optim.Adam:
        return "Adam"
    return None


def _decoupled(opt, name: str) -> bool:
    return name == "AdamW" or bool(opt.defaults.get("decoupled_weight_decay", False))


def _params(opt) -> list:
    return [p for group in opt.param_groups for p in group["params"]]


def why_not(opt, name: str) -> str | None:
    """Why `opt` cannot take torch's fused kernel (None: it can)."""
    groups = opt.param_groups
    if any(g.get("foreach") for g in groups):
        return "built with foreach=True"
    if any(g.get("differentiable") for g in groups):
        return "built with differentiable=True"
    params = _params(opt)
    for p in params:
        if type(p) not in (torch.Tensor, torch.nn.Parameter):
            return f"a parameter is a {type(p).__name__}, not a plain tensor"
        if not torch.is_floating_point(p):
            return f"a parameter is {p.dtype}"
        if not p.is_contiguous():
            return "a parameter is not contiguous (the fused kernel reads it as a flat array)"
    decoupled = _decoupled(opt, name)
    for device_type in sorted({p.device.type for p in params}):
        if not for_device(device_type).has_fused_adam(decoupled):
            op = "_fused_adamw_" if decoupled else "_fused_adam_"
            return f"torch has no {op} kernel for {device_type} here"
    return None


def _step_to_fused_form(opt) -> None:
    """Each parameter's `step` as the fused kernel keeps it: its own fp32 tensor on the
    parameter's device (torch's load_state_dict does this for a fused group)."""
    for p in _params(opt):
        state = opt.state.get(p)
        if state and "step" in state:
            step = state["step"]
            value = float(step) if not torch.is_tensor(step) else step
            state["step"] = torch.as_tensor(value, dtype=torch.float32).to(p.device).clone()


def _set_fused(opt, on: bool) -> None:
    opt.defaults["fused"] = on or None
    for group in opt.param_groups:
        group["fused"] = on or None
    if on:
        opt._step_supports_amp_scaling = True
        _step_to_fused_form(opt)


def _grads_fit(opt) -> str | None:
    """Why this step's gradients cannot go to the fused kernel (None: they can)."""
    for p in _params(opt):
        g = p.grad
        if g is not None and (not g.is_contiguous() or g.shape != p.shape or g.dtype != p.dtype
                              or g.device != p.device):
            return (f"a gradient of shape {tuple(g.shape)} {g.dtype} is not a contiguous match of its "
                    f"parameter ({tuple(p.shape)} {p.dtype})")
    return None


def _fallback_line(name: str, device_type: str, reason: str) -> str:
    return (f"npuspeed: Megatron's torch {name} is not fused here ({reason}); it runs "
            f"{describe(name, False, device_type)}")


def _record(opt, name: str, fused: bool, reason: str | None) -> dict:
    params = _params(opt)
    device_type = params[0].device.type if params else "none"
    entry = {"class": name, "fused": fused, "device": device_type, "params": sum(p.numel() for p in params),
             "implementation": describe(name, fused, device_type), "reason": reason}
    _BUILT.append(entry)
    return entry


def _pre_step(opt, args, kwargs) -> None:
    """Step pre hook: the gradients still fit the kernel, else torch's unfused update from now on."""
    entry = getattr(opt, ATTR, None)
    if entry is None or not entry["fused"]:
        return
    reason = _grads_fit(opt)
    if reason is None:
        return
    _set_fused(opt, False)
    entry.update(fused=False, reason=reason, implementation=describe(entry["class"], False, entry["device"]))
    log.warning(_fallback_line(entry["class"], entry["device"], reason) + " from this step on")


def _post_step(opt, args, kwargs) -> None:
    if all(g.get("fused") for g in opt.param_groups):
        telemetry.count(STEPS)


def _post_state_dict(opt, state_dict):
    """A checkpoint holds the param groups as Megatron built them (fused unset): a run without
    npuspeed, or on a device without the kernel, loads it as one of its own."""
    for group in state_dict.get("param_groups", []):
        if "fused" in group:
            group["fused"] = None
    return state_dict


def _post_load(opt) -> None:
    """A checkpoint's param groups replaced the optimizer's: the run's choice again."""
    entry = getattr(opt, ATTR, None)
    if entry is not None:
        _set_fused(opt, entry["fused"])


def adopt(opt, fuse: bool = True) -> dict | None:
    """Make `opt` (a torch optimizer Megatron built) torch's fused Adam where it can take it
    (`fuse=False`: only record it as built, --npuspeed-adam megatron); returns the record, None
    for what is not torch's Adam/AdamW."""
    name = _torch_adam(opt)
    if name is None or getattr(opt, ATTR, None) is not None or not _params(opt):
        return None
    already = all(g.get("fused") for g in opt.param_groups)
    reason = None if already else ("--npuspeed-adam megatron" if not fuse else why_not(opt, name))
    entry = _record(opt, name, reason is None, reason)
    setattr(opt, ATTR, entry)
    if reason is not None:
        telemetry.count(KEPT)
        if telemetry.once(("fused_adam", reason)):
            (log.info if not fuse else log.warning)(_fallback_line(name, entry["device"], reason))
        return entry
    _set_fused(opt, True)
    telemetry.count(FUSED)
    opt.register_step_pre_hook(_pre_step)
    opt.register_step_post_hook(_post_step)
    opt.register_state_dict_post_hook(_post_state_dict)
    opt.register_load_state_dict_post_hook(_post_load)
    return entry


def _inner(result):
    """The torch optimizer in what `_get_megatron_optimizer_based_on_param_groups` returned: a
    Megatron optimizer wrapping it (`.optimizer`), or (optimizer, init_state_fn) in 0.18+
    with skip_megatron_wrapping."""
    if isinstance(result, tuple):
        return result[0] if result else None
    return getattr(result, "optimizer", None)


def adopting(mode: str):
    """Wrapper factory for `_get_megatron_optimizer_based_on_param_groups`: each torch Adam it
    builds is adopted (auto) or only recorded as Megatron built it (megatron)."""
    if mode not in MODES:  # argparse's choices keep this from happening from the command line
        raise ValueError(f"--npuspeed-adam {mode!r}: one of {', '.join(MODES)}")

    def wrap(build):
        @functools.wraps(build)
        def wrapped(*args, **kwargs):
            result = build(*args, **kwargs)
            inner = _inner(result)
            if isinstance(inner, torch.optim.Optimizer):
                adopt(inner, fuse=mode == "auto")
            return result

        return wrapped

    return wrap


def built() -> list[dict]:
    """Every torch Adam/AdamW megatron-core built in this process, as adopted."""
    return [dict(e) for e in _BUILT]


def summary() -> str | None:
    """One line naming the implementation(s) that ran (None: no torch Adam was built)."""
    names = sorted({e["implementation"] for e in _BUILT})
    return "; ".join(names) if names else None


def plan_line(mode: str, decoupled_weight_decay: bool = True, device_type: str | None = None) -> str:
    """What a run here will use, before any optimizer is built (the report's line)."""
    name = "AdamW" if decoupled_weight_decay else "Adam"
    where = "where Megatron falls back to torch's Adam: "
    if mode == "megatron":
        return where + (describe(name, False, device_type) if device_type else f"torch {name} as Megatron builds it") \
            + " (--npuspeed-adam megatron)"
    if device_type is None:
        return where + f"torch {name} fused=True where the device has the kernel"
    fused = for_device(device_type).has_fused_adam(decoupled_weight_decay)
    return where + describe(name, fused, device_type) + ("" if fused else f" (no fused kernel for {device_type})")


def register(registry, feature: str, mode: str) -> None:
    """One wrapper in every release (the name and its two return shapes are the same in 0.12-0.19)."""
    registry.register(TARGET, wrapper=adopting(mode), feature=feature, megatron=">=0.12,<0.20")
