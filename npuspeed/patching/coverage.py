"""The net under every feature: an enabled flag whose patches all skipped is refused at start-up.

A patch outside its megatron-core range is skipped (registry.py), which is right per patch
but, for a feature whose every patch skipped, leaves the flag accepted and doing nothing.
`refuse_idle` runs after `registry.apply()` for every enabled feature (the always-on device
layer aside) and raises one line naming the flag given, the running release, the ranges the
patches were written for and a release to install. A feature that registers no patch at all
in a run must say why (`Feature.idle_reason`); without one it is refused too, so a feature
whose registration became conditional cannot idle unnoticed. Features' own earlier checks
(`needs_release`) stay where they say more; this is the net, independent of the ranges.
"""
from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from npuspeed.errors import UserError
from npuspeed.patching import versions

#: the first release that ships cp312-only wheels (the fix then needs Python 3.12)
NEEDS_PY312 = Version("0.17")


class IdleFeatureError(UserError, ValueError):
    """An enabled feature has nothing to do on the running megatron-core."""


def given_flags(feature, argv) -> list[str]:
    """The feature's flags on the command line (exact, or `--flag=value`), in its own order."""
    words = {a.split("=", 1)[0] for a in argv if isinstance(a, str) and a.startswith("--")}
    found = [f for f in getattr(feature, "flags", ()) if f in words]
    return found or list(getattr(feature, "flags", ())[:1]) or [feature.name]


def supported_minors() -> list[Version]:
    """0.12, 0.13, ... : the minor releases SUPPORTED_MEGATRON admits (read, never listed twice)."""
    spec = SpecifierSet(versions.SUPPORTED_MEGATRON)
    return [Version(f"0.{m}") for m in range(100) if Version(f"0.{m}.0") in spec]


def release_for(ranges: list[str]) -> Version | None:
    """The newest supported minor release some range admits (any of its patch releases)."""
    fits = [m for m in supported_minors()
            if any(Version(f"{m}.{p}") in SpecifierSet(r) for r in ranges for p in (0, 1, 2, 99))]
    return max(fits) if fits else None


def fix_for(ranges: list[str], flag: str) -> str:
    minor = release_for(ranges)
    if minor is None:
        return f"no supported megatron-core has them: drop {flag}"
    pin = f"megatron-core>={minor},<0.{minor.minor + 1}"
    python = ", on Python 3.12" if minor >= NEEDS_PY312 else ""
    return f"install megatron-core {minor} (`pip install '{pin}'`{python}) or drop {flag}"


def idle_message(feature, patches, argv) -> str | None:
    """Why `feature` (enabled) does nothing after apply, as one line, or None when it acts."""
    flags = given_flags(feature, argv)
    version = versions.megatron_version()
    if not patches:
        return (f"{' '.join(flags)}: npuspeed's {feature.name} registered no patch on megatron-core {version}, so "
                f"the flag would do nothing (an npuspeed bug: please report it); drop {flags[0]}")
    if any(p.status == "applied" for p in patches):
        return None
    ranges = sorted({p.megatron for p in patches if p.megatron and "outside" in p.reason})
    others = sorted({f"{p.target}: {p.reason}" for p in patches if "outside" not in p.reason})
    why = f"its patches are written for megatron-core {' or '.join(ranges)}" if ranges else ""
    why = "; ".join(w for w in [why, *others] if w)
    return (f"{' '.join(flags)} does nothing on megatron-core {version}: {why}; "
            f"{fix_for(ranges, flags[0]) if ranges else f'drop {flags[0]}'}")


def refuse_idle(features, registry, ctx) -> None:
    """Raise IdleFeatureError for the first enabled feature with nothing applied (after apply)."""
    for feature in features:
        if getattr(feature, "always_on", False):
            continue  # the device layer: its patches are per backend and release by design
        patches = registry.patches(feature.name)
        if not patches and feature.idle_reason(ctx):
            continue  # acts without patches here (e.g. through other features' flags): it says why
        message = idle_message(feature, patches, ctx.argv)
        if message:
            raise IdleFeatureError(message)
