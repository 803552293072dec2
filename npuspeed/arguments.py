"""npuspeed's flags: one argparse group built from the features it is given.

The runtime hands the feature list in (this module imports nothing from npuspeed, so the
features, which sit above it, never form a loop with it). Flags are read from the command line (Megatron's own flags pass through untouched) plus
`NPUSPEED_ARGS`, for launchers that own the command line. Megatron-LM's parser learns the
same group, so an unchanged Megatron-LM script accepts them; flags Megatron already
defines (e.g. `--use-flash-attn`) are shared, not redefined.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

from npuspeed.errors import UserError

GROUP_TITLE = "npuspeed"
ENV = "NPUSPEED_ARGS"


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors raise UserError: one `npuspeed: error:` line from rank 0,
    not a usage block from every rank."""

    def error(self, message):
        raise UserError(f"{message} (see --help; --npuspeed-help lists npuspeed's flags)")


def add_arguments(parser: argparse.ArgumentParser, features) -> argparse.ArgumentParser:
    """Add the features' group to `parser`, skipping flags it already has."""
    group = parser.add_argument_group(GROUP_TITLE, "npuspeed acceleration features")
    existing = set(parser._option_string_actions)
    proxy = _SkipExisting(group, existing)
    for feature in features:
        feature.add_arguments(proxy)
    return parser


class _SkipExisting:
    """Forwards add_argument to an argparse group unless every option string exists already."""

    def __init__(self, group, existing: set):
        self._group, self._existing = group, existing

    def add_argument(self, *names, **kwargs):
        if names and all(n in self._existing for n in names):
            return None
        return self._group.add_argument(*names, **kwargs)

    def __getattr__(self, name):
        return getattr(self._group, name)


def build_parser(features) -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="npuspeed", add_help=False, allow_abbrev=False)
    add_arguments(parser, features)
    parser.add_argument("--npuspeed-help", action="store_true", help="List npuspeed's features and flags.")
    return parser


def argv_with_env(argv: list[str] | None = None) -> list[str]:
    """`argv` (the command line when None) plus NPUSPEED_ARGS: what a run is initialised with."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return argv + shlex.split(os.environ.get(ENV, ""))


def parse_args(features, argv: list[str]) -> argparse.Namespace:
    """Parse the features' flags in `argv` (already with NPUSPEED_ARGS), leaving the rest."""
    parser = build_parser(features)
    _check_env_spelling(parser)
    args, _unknown = parser.parse_known_args(list(argv))
    return args


def _check_env_spelling(parser: argparse.ArgumentParser) -> None:
    """A word in NPUSPEED_ARGS that is one typo away from an npuspeed flag is an error: in a
    Megatron-LM script no other parser reads NPUSPEED_ARGS, so the feature would silently stay
    off. (Other words pass: features read Megatron's flags, e.g. --bf16, from there too.)"""
    import difflib

    _args, unknown = parser.parse_known_args(shlex.split(os.environ.get(ENV, "")))
    known = [o for o in parser._option_string_actions if o.startswith("--")]
    for word in unknown:
        flag = word.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.85) if flag.startswith("--") else []
        if close:
            raise UserError(f"{ENV}: unrecognized argument {flag}; did you mean {close[0]}? "
                            "(--npuspeed-help lists npuspeed's flags)")


def features_help(features) -> str:
    """Each feature, whether it is opt-in, its flags and the module that owns them."""
    lines = ["npuspeed features and their flags (and the module that owns them):"]
    for feature in features:
        flags = ", ".join(feature.flags) or "(no flags)"
        state = "always on" if feature.always_on else "opt-in"
        owner = (feature.Config or type(feature)).__module__
        lines.append(f"  {feature.name:<28} {state:<9} {flags}  [{owner}]")
    lines.append("")
    lines.append(build_parser(features).format_help())
    return "\n".join(lines)

