"""Megatron-LM's parser learns npuspeed's flags, so its unchanged scripts accept them.

The flag group comes from the runtime (`ctx.extend_parser`), which owns the feature list:
this module needs nothing above the features.
"""
from __future__ import annotations

import functools


def parse_args_wrapper(extend_parser):
    """Wrapper factory for `megatron.training.arguments.parse_args`: `extend_parser(parser)`
    adds npuspeed's group after the script's own extra-args provider."""

    def wrap(parse_args_fn):
        @functools.wraps(parse_args_fn)
        def parse_args(extra_args_provider=None, *args, **kwargs):
            def provider(parser):
                if extra_args_provider is not None:
                    parser = extra_args_provider(parser)
                return extend_parser(parser)

            return parse_args_fn(provider, *args, **kwargs)

        return parse_args

    return wrap
