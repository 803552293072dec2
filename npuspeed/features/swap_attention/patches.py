"""--swap-attention's one patch: TransformerBlock.__init__ wraps the chosen modules of each layer
(modules.py) around one swap manager for the process (swap.py)."""
from __future__ import annotations

#: below this many bytes a saved storage stays on the device (a copy costs more than it frees)
MIN_BYTES = 16 * 1024


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.features.swap_attention import modules, swap
    from npuspeed.features.swap_attention.modules import parse_modules

    manager = swap.install(swap.SwapManager(ctx.accelerator, MIN_BYTES))
    registry.register(modules.TARGET, wrapper=modules.selector(parse_modules(config.swap_modules), manager,
                                                               ctx.note), feature=feature)
