"""Attention activation swap (`--swap-attention [--swap-modules LIST]`, MindSpeed's names).

The activations autograd saves inside the chosen modules of every layer (default: the
attention block) are copied to pinned host memory on a side stream during forward, their
device storage freed, and fetched back in backward one layer ahead, overlapped with compute
(swap.py; which modules: modules.py). `--swap-attention-mode hidden` (default) swaps only the
layers whose copies the measured host link hides behind their measured compute, decided after
the first passes; `whole` swaps all and states the cost (sizer.py, npuspeed/offload/sizing.py).
A norm output that `--recompute-norm` frees and
recomputes (linear_qkv saves the input norm's) is left to it, not copied as well. On the CPU backend the host is the device: the
mechanics run (and are tested), nothing is saved, and the log and report say so.
"""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.swap_attention import patches as _patches, plan as _plan

from npuspeed.features.swap_attention.modules import MAIN, MODE, MODS, parse_mode, parse_modules  # noqa: F401


@dataclass(frozen=True)
class Config(FeatureConfig):
    swap_attention: bool = flag(MAIN, False)
    """Copy the activations saved inside the chosen modules (default the attention block) to
    pinned host memory in forward, free them on the device, and fetch them back one layer ahead
    in backward."""
    swap_modules: str | None = flag(MODS, None, type=str, metavar="LIST")
    """With --swap-attention: comma list of self_attention, core_attention, input_norm,
    post_attention_norm, mlp (default self_attention)."""
    swap_attention_mode: str | None = flag(MODE, None, type=str, metavar="MODE")
    """With --swap-attention: hidden (default) swaps only the layers whose copies the measured
    host link carries behind the layers' measured compute (decided after the first passes);
    whole swaps every layer, whatever it costs, and states the cost in one line."""
    # other features' flags this one cannot combine with (they own them: no --help here):
    # recompute_activation's, and adaptive_memory's budget and its "the policy chose the swap"
    recompute_activation_function: bool = False
    adaptive_recompute_device_size: float | None = None
    adaptive_swap: bool = False


class SwapAttentionFeature(Feature, name="swap_attention", Config=Config, patches=_patches, plan=_plan):
    def enabled(self, args) -> bool:
        config = self.config(args)
        return config.swap_attention or config.swap_modules is not None or config.swap_attention_mode is not None

    def validate(self, ctx) -> None:
        config = self.config(ctx.args)
        if not config.swap_attention:
            given = (f"{MODS} {config.swap_modules}" if config.swap_modules is not None
                     else f"{MODE} {config.swap_attention_mode}")
            raise FeatureError(f"{given} is given without {MAIN}; add {MAIN} (or drop {given.split()[0]})")
        names = parse_modules(config.swap_modules)
        parse_mode(config.swap_attention_mode)
        if "mlp" in names and config.recompute_activation_function:
            raise FeatureError(f"{MODS} mlp with --recompute-activation-function: the recompute frees the "
                               "activation the swap would copy; drop one of them")
        if config.adaptive_recompute_device_size is not None and not config.adaptive_swap:
            raise FeatureError(f"{MAIN} with --adaptive-recompute-device-size: the adaptive policy chooses swap "
                               f"itself (MindSpeed refuses the pair too); drop {MAIN}")
        acc = ctx.accelerator
        if acc.host_is_device():
            ctx.note(f"{MAIN}: the host is the device on the {acc.name} backend: activations are copied to "
                     "another place in the same memory and nothing is saved; by default nothing swaps (copies cannot "
                     "hide there), --swap-attention-mode whole runs the mechanics; the gain is measured on an "
                     "accelerator")
        elif not acc.has_pinned_memory():
            raise FeatureError(f"{MAIN} needs page-locked host memory for overlapped copies, which the "
                               f"{acc.name} backend does not offer here; drop {MAIN}")

    def running(self, ctx) -> str:
        config = self.config(ctx.args)
        if not config.swap_attention:
            return "off"
        from npuspeed import telemetry
        from npuspeed.features.swap_attention.modules import SELECTED
        from npuspeed.features.swap_attention.swap import PREFIX

        acc = ctx.accelerator
        where = ("host is the device (CPU backend): copies run, nothing is saved" if acc.host_is_device()
                 else f"pinned host memory, side stream on {acc.name}")
        counts = ", ".join(f"{k} {telemetry.get(PREFIX + k)}" for k in
                           ("groups", "groups_kept", "out_bytes", "in_bytes", "prefetched", "on_demand"))
        from npuspeed.features.swap_attention.sizer import FEATURE
        from npuspeed.offload import decisions

        sized = [d["line"] for d in decisions.all_dicts() if d["feature"] == FEATURE]
        mode = parse_mode(config.swap_attention_mode)
        return (f"saved_tensors_hooks on {', '.join(parse_modules(config.swap_modules))}; {where}; modules wrapped "
                f"in this process: {telemetry.get(SELECTED)}; {counts}; mode {mode}: "
                + ("; ".join(sized) if sized else "every group swaps until the first passes are measured"))
