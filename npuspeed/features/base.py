"""What a feature is: flags, validation, patches, and a line for the report."""
from __future__ import annotations

import argparse

from npuspeed.errors import UserError


class FeatureError(UserError, ValueError):
    """A flag combination the feature cannot honour; the message names the flag and the fix."""


class Feature:
    #: short name used in the registry and the report
    name: str = ""
    #: flags this feature owns (for --npuspeed-help)
    flags: tuple[str, ...] = ()
    #: True for features that apply whatever the flags say (the device layer)
    always_on: bool = False

    def add_arguments(self, group: argparse._ArgumentGroup) -> None:
        """Add this feature's flags to the npuspeed argument group."""

    def enabled(self, args: argparse.Namespace) -> bool:
        return self.always_on

    def validate(self, args: argparse.Namespace, accelerator) -> None:
        """Raise FeatureError for combinations that cannot work."""

    def prepare(self, args: argparse.Namespace, accelerator) -> None:
        """Side effects that must precede patching (enabled features only)."""

    def register_patches(self, registry, args: argparse.Namespace, accelerator) -> None:
        """Record this feature's patches in the registry (nothing is installed here)."""

    def path(self, args: argparse.Namespace, accelerator) -> str:
        """Which implementation runs, for the report (e.g. 'npu_fusion_attention')."""
        return "on" if self.enabled(args) else "off"
