"""The accelerator layer's error, in a module of its own so that helpers of the layer
(host_link.py) can raise it without importing base.py, which imports them."""
from __future__ import annotations

from npuspeed.errors import UserError


class AcceleratorError(UserError, RuntimeError):
    """A device that was asked for cannot be had."""
