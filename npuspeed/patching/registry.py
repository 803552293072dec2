"""The patch registry: features record intent, `apply()` installs it, `revert()` undoes it.

Replacement and wrappers are separate arguments (never guessed from a function's name).
Per target, apply composes: the replacement (or the original), then each wrapper in
registration order. Installing also rebinds by-value copies (`from x import f`) found in
loaded modules, except in torch's and npuspeed's own modules, whose references must stay
the real functions.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from npuspeed.patching.resolve import Slot, TargetNotFound, resolve
from npuspeed.patching.versions import in_range, megatron_version

_REBIND_SKIP = ("npuspeed", "torch")
_SHARED_CONSTANTS = (type(None), bool, int, float, str, bytes)


class PatchError(RuntimeError):
    """A patch cannot be registered or applied as asked."""


@dataclass
class Patch:
    target: str
    feature: str
    kind: str  # "replace" or "wrap"
    fn: Callable
    megatron: str | None
    if_missing: bool = False
    status: str = "registered"  # registered | applied | skipped
    reason: str = ""

    def as_dict(self) -> dict:
        return {
            "target": self.target,
            "feature": self.feature,
            "kind": self.kind,
            "status": self.status,
            "reason": self.reason,
            "megatron": self.megatron,
        }


@dataclass
class _Installed:
    slot: Slot
    original: Any
    composed: Any
    rebound: list = field(default_factory=list)  # (module, name)


def _skip_module(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in _REBIND_SKIP)


class PatchRegistry:
    def __init__(self):
        self._patches: list[Patch] = []
        self._installed: dict[str, _Installed] = {}

    # -- intent --------------------------------------------------------------------------------
    def register(
        self,
        target: str,
        replacement: Callable | None = None,
        *,
        wrapper: Callable[[Callable], Callable] | None = None,
        feature: str,
        megatron: str | None = ">=0.12",
        if_missing: bool = False,
    ) -> Patch:
        """Record a replacement of `target` or a wrapper around it (exactly one of the two).

        `megatron` is the version range in which the target exists; outside it the patch
        is skipped and the report says so. None means the target is not Megatron's.
        `if_missing=True` provides a name upstream forgot to define (e.g. one only bound
        when an optional package imports): installed only where it is absent.
        """
        if (replacement is None and not if_missing) == (wrapper is None):
            raise PatchError(f"{feature}: register {target!r} with a replacement or a wrapper, not both")
        kind = "replace" if replacement is not None or if_missing else "wrap"
        if kind == "replace":
            for other in self._patches:
                if other.target == target and other.kind == "replace":
                    raise PatchError(
                        f"{target!r} is replaced by two features: {other.feature!r} and "
                        f"{feature!r}; one must wrap instead, or the features are incompatible"
                    )
        if if_missing and kind != "replace":
            raise PatchError(f"{feature}: if_missing needs a replacement value for {target!r}")
        patch = Patch(target, feature, kind, replacement if replacement is not None else wrapper,
                      megatron, if_missing)
        self._patches.append(patch)
        return patch

    def patches(self, feature: str | None = None) -> list[Patch]:
        return [p for p in self._patches if feature is None or p.feature == feature]

    # -- installing ----------------------------------------------------------------------------
    def apply(self) -> None:
        """Install every registered patch not yet installed. Applying twice is a no-op."""
        pending: dict[str, list[Patch]] = {}
        fresh: list[_Installed] = []
        for patch in self._patches:
            if patch.status == "registered":
                pending.setdefault(patch.target, []).append(patch)
        for target, new in pending.items():
            live = [p for p in new if self._admit(p)]
            if not live:
                continue
            if target in self._installed:  # recompose with the earlier patches of the target
                self._uninstall(target)
            record = self._install(target, [p for p in self._patches if p.target == target and p.status != "skipped"])
            if record is not None:
                fresh.append(record)
        _rebind(fresh)

    def _admit(self, patch: Patch) -> bool:
        if not in_range(patch.megatron):
            patch.status = "skipped"
            patch.reason = f"megatron-core {megatron_version()} outside {patch.megatron}"
            return False
        return True

    def _install(self, target: str, patches: list[Patch]) -> _Installed:
        if_missing = any(p.if_missing for p in patches)
        try:
            slot = resolve(target, allow_absent=if_missing)
        except TargetNotFound as exc:
            features = sorted({p.feature for p in patches})
            raise PatchError(
                f"feature {', '.join(features)}: patch target {target!r} does not exist in the "
                f"installed megatron-core {megatron_version()} ({exc}); this npuspeed does not "
                "support that Megatron version for this feature"
            ) from exc
        if if_missing and not slot.absent:
            for patch in patches:
                patch.status, patch.reason = "skipped", "already defined upstream"
            return None
        original = slot.original
        fn = original
        for patch in sorted(patches, key=lambda p: p.kind != "replace"):
            fn = patch.fn if patch.kind == "replace" else patch.fn(fn)
        marked = fn
        if callable(fn) and not isinstance(fn, type):
            try:
                fn.__npuspeed_patch__ = target
            except (AttributeError, TypeError):  # builtins cannot carry attributes
                marked = _marked(fn, target)
        slot.install(marked)
        record = _Installed(slot, original, marked)
        self._installed[target] = record
        for patch in patches:
            patch.status, patch.reason = "applied", ""
        return record

    # -- undoing -------------------------------------------------------------------------------
    def _uninstall(self, target: str) -> None:
        record = self._installed.pop(target)
        for module, name in record.rebound:
            if module.__dict__.get(name) is record.composed:
                setattr(module, name, record.original)
        record.slot.restore()
        for patch in self._patches:
            if patch.target == target and patch.status == "applied":
                patch.status = "registered"

    def revert(self) -> None:
        """Restore every original, newest install first."""
        for target in reversed(list(self._installed)):
            self._uninstall(target)

    def remove(self, feature: str) -> None:
        """Undo and forget one feature's patches; other features' patches stay installed."""
        targets = {p.target for p in self._patches if p.feature == feature}
        for target in targets:
            if target in self._installed:
                self._uninstall(target)
        self._patches = [p for p in self._patches if p.feature != feature]
        self.apply()

    def clear(self) -> None:
        """Revert and forget all registrations (tests)."""
        self.revert()
        self._patches.clear()

    def is_applied(self, target: str) -> bool:
        return target in self._installed

    def original(self, target: str) -> Any:
        """The function a target had before npuspeed patched it."""
        return self._installed[target].original

    def report(self) -> list[dict]:
        return [p.as_dict() for p in self._patches]


def _marked(fn: Callable, target: str) -> Callable:
    @functools.wraps(fn)
    def marked(*args, **kwargs):
        return fn(*args, **kwargs)

    marked.__npuspeed_patch__ = target
    return marked


def _rebind(records: list[_Installed]) -> None:
    """Point by-value copies of each original in loaded modules at its patched version."""
    # An `if_missing` slot had no original, and a flag's value (False, None, 0) is shared by
    # every module that holds the same constant: only real copies (functions, classes,
    # objects) are rebound.
    by_id = {id(r.original): r for r in records
             if not isinstance(r.original, (type(sys), *_SHARED_CONSTANTS)) and not r.slot.absent}
    if not by_id:
        return
    for name, module in list(sys.modules.items()):
        if module is None or _skip_module(name):
            continue
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        for attr, value in items:
            record = by_id.get(id(value))
            if record is not None and value is record.original and record.slot.owner is not module:
                setattr(module, attr, record.composed)
                record.rebound.append((module, attr))
