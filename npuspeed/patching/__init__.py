"""The process-wide patch registry (see registry.py for the contract)."""
from npuspeed.patching.registry import Patch, PatchError, PatchRegistry

registry = PatchRegistry()

__all__ = ["Patch", "PatchError", "PatchRegistry", "registry"]
