"""Which module calls swap: the chosen submodules of every transformer layer.

Chosen when a TransformerBlock is built. A chosen module's forward (an instance attribute, so
the state dict is unchanged) opens one swap group per call while autograd records; calls made
without grad, and the recompute of a layer under full recompute (which runs inside backward
and is consumed at once), run as they are.
"""
from __future__ import annotations

import functools

import torch

from npuspeed.features.base import FeatureError, after_init

#: the feature's flags (swap_attention_feature.py declares them; patches and plan name them)
MAIN, MODS, MODE = "--swap-attention", "--swap-modules", "--swap-attention-mode"

TARGET = "megatron.core.transformer.transformer_block.TransformerBlock.__init__"
#: --swap-modules names -> the module's path inside a TransformerLayer
MODULES = {
    "self_attention": "self_attention",
    "core_attention": "self_attention.core_attention",
    "input_norm": "input_layernorm",
    "post_attention_norm": "pre_mlp_layernorm",
    "mlp": "mlp",
}
DEFAULT = "self_attention"
SELECTED = "swap.modules"


def _submodule(layer, path: str):
    m = layer
    for part in path.split("."):
        m = getattr(m, part, None)
        if m is None:
            return None
    return m


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _wrap(module, manager, name: str, layer: int) -> None:
    forward = module.forward

    @functools.wraps(forward)
    def swapped_forward(*args, **kwargs):
        if not torch.is_grad_enabled() or _in_backward():
            return forward(*args, **kwargs)
        group = manager.group(f"layer{layer}.{name}", layer)
        if not group.hooked:
            return forward(*args, **kwargs)
        with group.hooks():
            return forward(*args, **kwargs)

    module.forward = swapped_forward


def select(block, names: list[str], manager, note) -> None:
    from npuspeed import telemetry

    for layer in getattr(block, "layers", ()):
        number = getattr(layer, "layer_number", 0)
        for name in names:
            module = _submodule(layer, MODULES[name])
            if module is None or type(module).__name__ == "IdentityOp":
                note(f"--swap-modules {name}: this layer has no such module; skipped")
                continue
            _wrap(module, manager, name, number)
            telemetry.count(SELECTED)


def selector(names: list[str], manager, note):
    return after_init(select, names, manager, note)


def parse_mode(raw: str | None) -> str:
    """--swap-attention-mode: hidden (default: only what the host link carries behind the
    compute) or whole (every chosen module, whatever it costs; the cost is stated)."""
    from npuspeed.offload.sizing import MODES

    mode = (raw or "hidden").strip().lower()
    if mode not in MODES:
        raise FeatureError(f"{MODE} {raw!r}: give hidden (move only what the host link hides behind the layers' "
                           "compute; the default) or whole (move everything, at the cost the log states)")
    return mode


def parse_modules(raw: str | None) -> list[str]:
    """The --swap-modules names (default DEFAULT); an unknown one is refused naming the choices."""
    names = [n.strip() for n in (raw or DEFAULT).split(",") if n.strip()]
    bad = [n for n in names if n not in MODULES]
    if bad or not names:
        raise FeatureError(f"{MODS} {raw!r}: unknown module {', '.join(bad) or '(none)'}; give a comma list of "
                           f"{', '.join(MODULES)}")
    return names
