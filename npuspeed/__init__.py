"""npuspeed: accelerator-affine acceleration for Megatron-Core, one import away.

The public API is small: `get_accelerator()`, the patch `registry`, `report()`, and
`add_arguments(parser)` for scripts with their own parser.
Importing this package has no side effects; `npuspeed.megatron_adaptor` is the import
that applies patches.
"""
from npuspeed.accelerator import get_accelerator
from npuspeed.patching import registry

from npuspeed._version import __version__


def report(as_json: bool = False):
    """What runs here: device, features, patches, ops (see `npuspeed report`)."""
    from npuspeed.reporting import collect, render

    data = collect()
    return data if as_json else render(data)


def add_arguments(parser):
    """Add npuspeed's flag group (every feature's flags) to a script's own argparse parser."""
    from npuspeed import arguments
    from npuspeed.features import all_features

    return arguments.add_arguments(parser, all_features())


__all__ = ["__version__", "add_arguments", "get_accelerator", "registry", "report"]
