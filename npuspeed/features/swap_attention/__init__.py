"""Attention activation swap (`--swap-attention [--swap-modules LIST]`, MindSpeed's names).

The activations autograd saves inside the chosen modules of every layer (default: the
attention block) are copied to pinned host memory on a side stream during forward, their
device storage freed, and fetched back in backward one layer ahead, overlapped with compute
(swap.py; which modules: modules.py). A norm output that `--recompute-norm` frees and
recomputes (linear_qkv saves the input norm's) is left to it, not copied as well. On the CPU backend the host is the device: the
mechanics run (and are tested), nothing is saved, and the log and report say so.
"""
from __future__ import annotations

from npuspeed.features.base import Feature, FeatureError

MAIN, MODS = "--swap-attention", "--swap-modules"
#: below this many bytes a saved storage stays on the device (a copy costs more than it frees)
MIN_BYTES = 16 * 1024


def parse_modules(raw: str | None) -> list[str]:
    from npuspeed.features.swap_attention.modules import DEFAULT, MODULES

    names = [n.strip() for n in (raw or DEFAULT).split(",") if n.strip()]
    bad = [n for n in names if n not in MODULES]
    if bad or not names:
        raise FeatureError(f"{MODS} {raw!r}: unknown module {', '.join(bad) or '(none)'}; give a comma list of "
                           f"{', '.join(MODULES)}")
    return names


class SwapAttentionFeature(Feature):
    name = "swap_attention"
    flags = (MAIN, MODS)

    def add_arguments(self, group) -> None:
        group.add_argument(MAIN, action="store_true",
                           help="Copy the activations saved inside the chosen modules (default the attention "
                                "block) to pinned host memory in forward, free them on the device, and fetch "
                                "them back one layer ahead in backward.")
        group.add_argument(MODS, type=str, default=None, metavar="LIST",
                           help=f"With {MAIN}: comma list of self_attention, core_attention, input_norm, "
                                "post_attention_norm, mlp (default self_attention).")

    def enabled(self, args) -> bool:
        return bool(getattr(args, "swap_attention", False)) or getattr(args, "swap_modules", None) is not None

    def validate(self, ctx) -> None:
        args = ctx.args
        if not getattr(args, "swap_attention", False):
            raise FeatureError(f"{MODS} {args.swap_modules} is given without {MAIN}; add {MAIN} (or drop {MODS})")
        names = parse_modules(args.swap_modules)
        if "mlp" in names and getattr(args, "recompute_activation_function", False):
            raise FeatureError(f"{MODS} mlp with --recompute-activation-function: the recompute frees the "
                               "activation the swap would copy; drop one of them")
        if getattr(args, "adaptive_recompute_device_size", None) is not None and not getattr(args, "adaptive_swap",
                                                                                                False):
            raise FeatureError(f"{MAIN} with --adaptive-recompute-device-size: the adaptive policy chooses swap "
                               f"itself (MindSpeed refuses the pair too); drop {MAIN}")
        acc = ctx.accelerator
        if acc.host_is_device():
            ctx.note(f"{MAIN}: the host is the device on the {acc.name} backend: activations are copied to "
                     "another place in the same memory and nothing is saved; the mechanics run, the gain is "
                     "measured on an accelerator")
        elif not acc.has_pinned_memory():
            raise FeatureError(f"{MAIN} needs page-locked host memory for overlapped copies, which the "
                               f"{acc.name} backend does not offer here; drop {MAIN}")

    def register_patches(self, registry, ctx) -> None:
        from npuspeed.features.swap_attention import modules, swap

        manager = swap.install(swap.SwapManager(ctx.accelerator, MIN_BYTES))
        registry.register(modules.TARGET, wrapper=modules.selector(parse_modules(ctx.args.swap_modules), manager,
                                                                   ctx.note), feature=self.name)

    def plan_effect(self, model, ctx):
        from npuspeed.features.base import PlanEffect

        names = parse_modules(ctx.args.swap_modules)
        if ctx.accelerator.host_is_device():
            return PlanEffect(summary=f"{MAIN}: saved activations of {', '.join(names)} copied to host memory; the "
                                      "host is the device here: nothing leaves it")
        return PlanEffect(swap_modules=tuple(names),
                          summary=f"{MAIN}: saved activations of {', '.join(names)} kept in host memory between "
                                  "forward and backward; on the device: the layer in backward and the one fetched "
                                  "ahead")

    def path(self, ctx) -> str:
        args = ctx.args
        if not getattr(args, "swap_attention", False):
            return "off"
        from npuspeed import telemetry
        from npuspeed.features.swap_attention.modules import SELECTED
        from npuspeed.features.swap_attention.swap import PREFIX

        acc = ctx.accelerator
        where = ("host is the device (CPU backend): copies run, nothing is saved" if acc.host_is_device()
                 else f"pinned host memory, side stream on {acc.name}")
        counts = ", ".join(f"{k} {telemetry.get(PREFIX + k)}" for k in
                           ("groups", "out_bytes", "in_bytes", "prefetched", "on_demand"))
        return (f"saved_tensors_hooks on {', '.join(parse_modules(args.swap_modules))}; {where}; modules wrapped "
                f"in this process: {telemetry.get(SELECTED)}; {counts}")


__all__ = ["SwapAttentionFeature", "FeatureError"]
