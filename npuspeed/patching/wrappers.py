"""Wrapper factories for registry patches that only change the context a target runs in, or add
a step after it, and the argument binding the wrappers that read a call share."""
from __future__ import annotations

import functools
import inspect


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


def followed_by(hook):
    """`wrapper=followed_by(hook)`: every call of a method target runs as before, then
    `hook(instance, result)`; the result is returned unchanged."""

    def wrap(fn):
        @functools.wraps(fn)
        def wrapped(self, *args, **kwargs):
            result = fn(self, *args, **kwargs)
            hook(self, result)
            return result

        return wrapped

    return wrap


def bound_call(signature: inspect.Signature, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """A call's arguments bound to the target's `signature`, its defaults filled in: what a wrapper
    reads by name (`.arguments`) however Megatron's caller passed them, and may change before
    calling the target with `*bound.args, **bound.kwargs`."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound
