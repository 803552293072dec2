"""Wrapper factories for registry patches that only change the context a target runs in."""
from __future__ import annotations

import functools


def within(make_context):
    """`wrapper=within(make_context)`: every call of the target runs inside a fresh
    `make_context()` (a device redirect, the device RNG state, no_grad, ...)."""

    def wrap(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with make_context():
                return fn(*args, **kwargs)

        return wrapped

    return wrap
