"""Which megatron-core is installed, and whether a patch's version range admits it.

The version is read from `megatron/core/package_info.py` of the megatron.core that
`import` picks, not from the installed distribution's metadata: with a Megatron-LM
checkout (or another megatron-core) on PYTHONPATH, the metadata names the pip-installed
one while the code that runs, and that the patches must match, is the checkout's. The
file is read rather than imported, since megatron.core must not be imported before the
device feature's apex guard. Metadata is the fallback.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import runpy
import sys
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from npuspeed.errors import UserError

SUPPORTED_MEGATRON = ">=0.12,<0.20"


class UnsupportedMegatronError(UserError, RuntimeError):
    """The installed megatron-core is outside the range npuspeed supports."""


@functools.lru_cache(maxsize=None)
def megatron_version() -> Version | None:
    """The version of the megatron-core that imports, or None when it is absent."""
    version = _package_info_version()
    if version is not None:
        return Version(version)
    try:
        return Version(metadata.version("megatron-core"))
    except metadata.PackageNotFoundError:
        return None


def importable(module: str) -> bool:
    """Whether `module` is installed, without importing it (only its parent packages): the one
    probe every feature uses for optional dependencies (transformer_engine, apex kernels, ...)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _package_info_version() -> str | None:
    loaded = sys.modules.get("megatron.core.package_info")
    if loaded is not None:
        return getattr(loaded, "__version__", None)
    try:
        spec = importlib.util.find_spec("megatron.core")  # imports only the `megatron` namespace
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "package_info.py")
        if os.path.isfile(path):
            try:
                return str(runpy.run_path(path)["__version__"])
            except Exception:  # an unreadable file: fall back to the metadata
                return None
    return None


def in_range(spec: str | None, version: Version | None = None) -> bool:
    """True when `version` (default: installed megatron-core) satisfies `spec`."""
    if spec is None:
        return True
    version = version if version is not None else megatron_version()
    if version is None:
        return False
    return Version(version.base_version) in SpecifierSet(spec)


def check_supported(version: Version | None = None) -> Version:
    """Raise a clear error when megatron-core is missing or outside the supported range."""
    version = version if version is not None else megatron_version()
    if version is None:
        raise UnsupportedMegatronError(
            "npuspeed needs megatron-core; install one in the supported range "
            f"with `pip install 'megatron-core{SUPPORTED_MEGATRON}'`."
        )
    if Version(version.base_version) not in SpecifierSet(SUPPORTED_MEGATRON):
        raise UnsupportedMegatronError(
            f"megatron-core {version} is not supported: npuspeed supports megatron-core "
            f"{SUPPORTED_MEGATRON} (0.12 through 0.19; 0.17 and later need Python 3.12). Install one with "
            f"`pip install 'megatron-core{SUPPORTED_MEGATRON}'`."
        )
    return version
