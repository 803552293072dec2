"""Shared room: the outputs a recompute frees once their consumer has run, for the other memory savers.

--recompute-norm frees a selected norm's output as soon as the next linear has saved it and
recomputes it just before that linear's backward. --swap-attention must not copy such a tensor
to host memory as well (it would be paid for twice), but the two features are separate folders:
so the recompute marks the output here from the norm's forward until its consumer's forward
hook frees it, and the swap asks `frees(t)`. Held weakly, by storage address: a dead output
drops out by itself, and an address reused by another storage is not mistaken for it.
"""
from __future__ import annotations

import weakref

import torch

#: storage address -> an output a recompute will free after its consumer ran (held weakly)
_PENDING: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def mark(out: torch.Tensor) -> None:
    """`out`'s storage will be freed once its consumer has run, and recomputed in backward."""
    _PENDING[out.untyped_storage().data_ptr()] = out


def unmark(out: torch.Tensor) -> None:
    """`out` is freed now (its consumer ran): nothing is pending for its storage any more."""
    _PENDING.pop(out.untyped_storage().data_ptr(), None)


def frees(t: torch.Tensor) -> bool:
    """Whether `t` lives in an output whose storage a recompute frees once its consumer has run
    and recomputes in backward (so another memory saver, e.g. the swap, leaves it alone)."""
    if not _PENDING:
        return False
    storage = t.untyped_storage()
    out = _PENDING.get(storage.data_ptr())
    return out is not None and out.untyped_storage().data_ptr() == storage.data_ptr() and storage.nbytes() > 0
