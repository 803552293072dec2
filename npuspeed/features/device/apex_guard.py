"""Keep a package that merely happens to be called `apex` away from Megatron.

Megatron's bare `import apex` succeeds for any `apex` on sys.path (PyPI's `apex` is a
web toolkit), after which it picks apex's fused kernels and crashes. NVIDIA apex is told
apart, without importing the impostor, by its `multi_tensor_apply` submodule.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import sys

log = logging.getLogger("npuspeed")


def classify_apex() -> str:
    """'absent', 'nvidia', 'blocked' or 'other'."""
    if "apex" in sys.modules and sys.modules["apex"] is None:
        return "blocked"
    try:
        spec = importlib.util.find_spec("apex")
    except (ImportError, ValueError):
        return "absent"
    if spec is None:
        return "absent"
    for root in spec.submodule_search_locations or []:
        if os.path.exists(os.path.join(root, "multi_tensor_apply")) or os.path.exists(
            os.path.join(root, "multi_tensor_apply.py")
        ):
            return "nvidia"
    return "other"


def guard_apex() -> str | None:
    """Hide a non-NVIDIA apex from imports; return the warning given, if any."""
    if classify_apex() != "other":
        return None
    origin = importlib.util.find_spec("apex").origin
    late = [m for m in ("megatron.core",) if m in sys.modules] and "apex" in sys.modules
    sys.modules["apex"] = None  # `import apex` now raises ImportError
    message = (
        f"npuspeed: the package 'apex' at {origin} is not NVIDIA apex; it is ignored "
        "(Megatron would otherwise pick apex's fused kernels and crash). "
        "Uninstall it (`pip uninstall apex`) to silence this warning."
    )
    if late:
        message += (
            " It was already imported by megatron.core: import npuspeed.megatron_adaptor "
            "before megatron so the guard can take effect."
        )
    log.warning(message)
    return message
