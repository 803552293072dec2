"""Megatron version ranges: what a patch admits and what npuspeed supports at all."""
from __future__ import annotations

import pytest
from packaging.version import Version

from npuspeed.patching import versions
from npuspeed.patching.versions import SUPPORTED_MEGATRON, UnsupportedMegatronError, check_supported, in_range


def test_installed_version_is_known_and_supported():
    installed = versions.megatron_version()
    assert isinstance(installed, Version)
    assert check_supported() == installed
    assert in_range(">=0.12") and in_range(None)


@pytest.mark.parametrize(
    "spec, version, expected",
    [
        (">=0.12", "0.11.0", False),
        (">=0.12", "0.12.0", True),
        (">=0.12,<0.17", "0.16.1", True),
        (">=0.12,<0.17", "0.17.0", False),
        (">=0.12,<0.17", "0.17.0rc1", False),  # a pre-release counts as its release
        (">=0.12,<0.17", "0.12.0rc3", True),
        ("<0.14", "0.14.0.dev0", False),
        (None, "0.1.0", True),
    ],
)
def test_in_range(spec, version, expected):
    assert in_range(spec, Version(version)) is expected


def test_in_range_without_megatron_is_false(monkeypatch):
    monkeypatch.setattr(versions, "megatron_version", lambda: None)
    assert in_range(">=0.12") is False
    assert in_range(None) is True


@pytest.mark.parametrize("version", ["0.11.0", "0.20.0", "0.11.9", "1.0.0"])
def test_check_supported_rejects_outside_range(version):
    with pytest.raises(UnsupportedMegatronError) as err:
        check_supported(Version(version))
    message = str(err.value)
    assert version in message
    assert ">=0.12,<0.20" in message and "0.12 through 0.19" in message
    assert "pip install" in message


@pytest.mark.parametrize("version", ["0.12.0", "0.13.1", "0.16.1", "0.16.0rc0", "0.17.0rc0", "0.19.2"])
def test_check_supported_accepts_in_range(version):
    assert check_supported(Version(version)) == Version(version)


def test_check_supported_without_megatron(monkeypatch):
    monkeypatch.setattr(versions, "megatron_version", lambda: None)
    with pytest.raises(UnsupportedMegatronError, match="needs megatron-core") as err:
        check_supported()
    assert SUPPORTED_MEGATRON in str(err.value)
