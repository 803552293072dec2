"""Refuse a feature flag that the built model gives nothing to do.

Some flags can be contradicted only by the model Megatron builds, not by the command line
(a megatron.core script may choose normalization or the layer spec in code): a
`--use-fused-rmsnorm` over LayerNorm, `--use-fused-swiglu` without a gated SiLU MLP,
`--use-flash-attn` under a Transformer Engine spec. Each active feature's `check_built`
looks at every TransformerBlock with layers once it is built; the first complaint is raised
as a FeatureError, at model build, naming the flag and what it needs.
"""
from __future__ import annotations

import functools

from npuspeed.features.base import Feature, FeatureError

TARGET = "megatron.core.transformer.transformer_block.TransformerBlock.__init__"
NAME = "build_check"


def _checked(features: list[Feature], ctx):
    def wrapper(init):
        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if len(getattr(self, "layers", ())) == 0:
                return  # a pipeline stage without layers: nothing to check
            for feature in features:
                problem = feature.check_built(self, ctx)
                if problem:
                    raise FeatureError(problem)

        return __init__

    return wrapper


def register(registry, features: list[Feature], ctx) -> None:
    """One wrapper on TransformerBlock.__init__ for every active feature that checks."""
    checking = [f for f in features if type(f).check_built is not Feature.check_built]
    if checking:
        registry.register(TARGET, wrapper=_checked(checking, ctx), feature=NAME)
