"""npuspeed: accelerator-affine acceleration for Megatron-Core, one import away.

The public API is small: `get_accelerator()`, the patch `registry`, and `report()`.
Importing this package has no side effects; `npuspeed.megatron_adaptor` is the import
that applies patches.
"""
from npuspeed.accelerator import get_accelerator
from npuspeed.patching import registry

__version__ = "0.1.0"


def report(as_json: bool = False):
    """What runs here: device, features, patches, ops (see `npuspeed report`)."""
    from npuspeed.report import collect, render

    data = collect()
    return data if as_json else render(data)


__all__ = ["__version__", "get_accelerator", "registry", "report"]
