"""--use-coc's patches: the forward (and, through functions.py, backward) of Megatron-Core's local
ColumnParallelLinear / RowParallelLinear, their __init__ (refuse what the chunks cannot run), and
build_module (up to 0.16 the layers are built through it)."""
from __future__ import annotations

LAYERS = "megatron.core.tensor_parallel.layers"
#: forward(input_, weight, runtime_gather_output) / forward(input_) in all of them; 0.18 adds the
#: inference all-gather, 0.19 GTP weight sharding (gtp_remat_size; refused at build)
MEGATRON_RANGE = ">=0.12,<0.20"


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.features.coc_overlap.layers import (Settings, build_module_wrapper, column_forward_wrapper,
                                                      init_wrapper, row_forward_wrapper)

    settings = Settings(config.coc_parallel_num, bool(config.use_ascend_mc2), ctx.accelerator, ctx.note)
    kw = dict(feature=feature, megatron=MEGATRON_RANGE)
    registry.register(f"{LAYERS}.ColumnParallelLinear.forward", wrapper=column_forward_wrapper(settings), **kw)
    registry.register(f"{LAYERS}.RowParallelLinear.forward", wrapper=row_forward_wrapper(settings), **kw)
    registry.register(f"{LAYERS}.ColumnParallelLinear.__init__", wrapper=init_wrapper("ColumnParallelLinear", ctx.note), **kw)
    registry.register(f"{LAYERS}.RowParallelLinear.__init__", wrapper=init_wrapper("RowParallelLinear", ctx.note), **kw)
    # up to 0.16 MLP/attention build their linears through build_module (refused there, early);
    # from 0.17 they call the spec's class directly: check_built looks at what was built
    registry.register("megatron.core.transformer.spec_utils.build_module", wrapper=build_module_wrapper, **kw)
