"""Turning a dotted target into (owner, attribute, original) and back.

`a.b.Class.method` is resolved by importing the longest module prefix and walking the
rest with getattr. For class attributes the raw descriptor is kept (from the class's
`__dict__`, or from the base class that defines an inherited one), so that staticmethod /
classmethod descriptors survive a patch and its revert; an inherited target is installed
on the named class and removed from it again on revert.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any


class TargetNotFound(LookupError):
    pass



@dataclass
class Slot:
    """Where a target lives and what was there."""

    owner: Any
    attr: str
    raw: Any  # the raw attribute (the descriptor for classes, found along the MRO)
    inherited: bool = False  # raw comes from a base class: revert deletes the override
    absent: bool = False  # not there at all (an `if_missing` patch): revert deletes it

    @property
    def original(self) -> Any:
        return _unwrap_descriptor(self.raw)

    def install(self, fn: Any) -> None:
        setattr(self.owner, self.attr, _rewrap_like(self.raw, fn))

    def restore(self) -> None:
        if self.inherited or self.absent:
            delattr(self.owner, self.attr)
        else:
            setattr(self.owner, self.attr, self.raw)


def _unwrap_descriptor(raw):
    if isinstance(raw, (staticmethod, classmethod)):
        return raw.__func__
    return raw


def _rewrap_like(raw, fn):
    if isinstance(raw, staticmethod) and not isinstance(fn, staticmethod):
        return staticmethod(fn)
    if isinstance(raw, classmethod) and not isinstance(fn, classmethod):
        return classmethod(fn)
    return fn


def resolve(target: str, allow_absent: bool = False) -> Slot:
    parts = target.split(".")
    module, index = None, 0
    for i in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:i])
        try:
            module = importlib.import_module(name)
            index = i
            break
        except ModuleNotFoundError as exc:
            # Only "this prefix is not a module" is expected; a broken import inside is not.
            if exc.name is None or not name.startswith(exc.name):
                raise
    if module is None:
        raise TargetNotFound(f"no importable module in {target!r}")
    owner: Any = module
    for part in parts[index:-1]:
        if not hasattr(owner, part):
            raise TargetNotFound(f"{target!r}: {part!r} not found")
        owner = getattr(owner, part)
    attr = parts[-1]
    if inspect.isclass(owner):
        if attr in vars(owner):
            return Slot(owner, attr, vars(owner)[attr])
        try:  # the base class's own descriptor, not a method bound to `owner`
            raw = inspect.getattr_static(owner, attr)
        except AttributeError:
            if not hasattr(owner, attr):
                if allow_absent:
                    return Slot(owner, attr, None, absent=True)
                raise TargetNotFound(f"{target!r}: {attr!r} not found") from None
            raw = getattr(owner, attr)
        return Slot(owner, attr, raw, inherited=True)
    if not hasattr(owner, attr):
        if allow_absent:
            return Slot(owner, attr, None, absent=True)
        raise TargetNotFound(f"{target!r}: {attr!r} not found")
    return Slot(owner, attr, getattr(owner, attr))
