"""--moe-tp-extend-ep's patches: initialize_model_parallel gets the EP x TP expert layout, and
every TransformerConfig built afterwards takes it (one wrapper per release range of __post_init__)."""
from __future__ import annotations


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.features.moe_tp_extend_ep.tp_extend_ep import (CONFIG, PARALLEL_STATE, config_wrapper,
                                                                 early_config_wrapper, init_wrapper)

    registry.register(f"{PARALLEL_STATE}.initialize_model_parallel", wrapper=init_wrapper, feature=feature,
                      megatron=">=0.12,<0.20")  # same keywords 0.12-0.19 (0.19 adds gtp/rank_offset ones)
    registry.register(f"{CONFIG}.__post_init__", wrapper=config_wrapper, feature=feature, megatron=">=0.12,<0.17")
    registry.register(f"{CONFIG}.__post_init__", wrapper=early_config_wrapper, feature=feature,
                      megatron=">=0.17,<0.20")
