"""--swap-attention's one patch: TransformerBlock.__init__ wraps the chosen modules of each layer
(modules.py) around one swap manager for the process (swap.py), sized by --swap-attention-mode
from the run's first passes (sizer.py)."""
from __future__ import annotations

#: below this many bytes a saved storage stays on the device (a copy costs more than it frees)
MIN_BYTES = 16 * 1024


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.accelerator import host_link
    from npuspeed.features.swap_attention import modules, swap
    from npuspeed.features.swap_attention.modules import parse_mode, parse_modules
    from npuspeed.features.swap_attention.sizer import LayerSizer

    acc = ctx.accelerator
    sizer = LayerSizer(acc, parse_mode(config.swap_attention_mode), lambda: host_link.link(acc), ctx.note)
    manager = swap.install(swap.SwapManager(acc, MIN_BYTES, sizer=sizer))
    registry.register(modules.TARGET, wrapper=modules.selector(parse_modules(config.swap_modules), manager,
                                                               ctx.note), feature=feature)
