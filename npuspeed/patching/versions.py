"""Which megatron-core is installed, and whether a patch's version range admits it."""
from __future__ import annotations

import functools
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

SUPPORTED_MEGATRON = ">=0.12,<0.17"


class UnsupportedMegatronError(RuntimeError):
    """The installed megatron-core is outside the range npuspeed supports."""


@functools.lru_cache(maxsize=None)
def megatron_version() -> Version | None:
    """The installed megatron-core version, or None when it is absent."""
    try:
        return Version(metadata.version("megatron-core"))
    except metadata.PackageNotFoundError:
        pass
    try:
        from megatron.core import package_info

        return Version(package_info.__version__)
    except Exception:
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
            f"{SUPPORTED_MEGATRON} (0.12 through 0.16). Install one with "
            f"`pip install 'megatron-core{SUPPORTED_MEGATRON}'`."
        )
    return version
