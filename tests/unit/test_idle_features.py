"""The structural net (npuspeed/patching/coverage.py), for every feature: enabled on a release
outside all its patches' ranges, it is refused with one line naming its flag, the release and
the fix. The per-feature command lines (tests/feature_argv.py) must cover every feature."""
from __future__ import annotations

import sys

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from feature_argv import FEATURE_ARGV
from feature_ctx import ctx_for
from npuspeed.features import all_features
from npuspeed.patching import coverage, versions
from npuspeed.patching.registry import PatchRegistry

OPT_IN = [f for f in all_features() if not f.always_on]


def test_table_names_every_feature():
    """A new feature must get a command line here, or it escapes the idle test and the per-release table."""
    assert set(FEATURE_ARGV) == {f.name for f in OPT_IN}


def _outside(ranges) -> Version | None:
    """A release no range admits (0.0 .. 0.99, 1.0), or None."""
    for candidate in [Version(f"0.{m}.0") for m in range(100)] + [Version("1.0.0")]:
        if not any(candidate in SpecifierSet(r) for r in ranges if r is not None):
            return candidate
    return None


def _registered(feature, ctx) -> PatchRegistry:
    reg = PatchRegistry()
    feature.register_patches(reg, ctx)
    return reg


@pytest.mark.parametrize("feature", OPT_IN, ids=[f.name for f in OPT_IN])
def test_feature_idle_on_other_release_is_refused(feature, monkeypatch):
    ctx = ctx_for(FEATURE_ARGV[feature.name])
    assert feature.enabled(ctx.args)
    reg = _registered(feature, ctx)
    patches = reg.patches(feature.name)
    if not patches:  # acts through something else here: it must say so
        assert feature.idle_reason(ctx), f"{feature.name} registers no patch and gives no reason"
        return
    assert all(p.megatron is not None for p in patches), "an opt-in feature patches Megatron: declare its range"
    fake = _outside([p.megatron for p in patches])
    if fake is None:  # shapes per range cover every release: move the ranges instead
        fake = Version("0.11.0")
        for patch in patches:
            patch.megatron = ">=99"
    monkeypatch.setattr(versions, "megatron_version", lambda: fake)
    monkeypatch.setattr(sys.modules["npuspeed.patching.registry"], "megatron_version", lambda: fake)
    reg.apply()  # every patch is outside: nothing is installed
    assert {p.status for p in patches} == {"skipped"}
    with pytest.raises(coverage.IdleFeatureError) as err:
        coverage.refuse_idle([feature], reg, ctx)
    line = str(err.value)
    assert "\n" not in line and str(fake) in line, line
    assert coverage.given_flags(feature, ctx.argv)[0] in line and FEATURE_ARGV[feature.name][0] in line, line
    assert "install megatron-core" in line or "drop" in line, line
    reg.clear()


def test_feature_without_patches_or_reason_is_refused():
    class Silent(type(OPT_IN[0])):
        name = "silent"

        def register_patches(self, registry, ctx):
            return None

    ctx = ctx_for(FEATURE_ARGV[OPT_IN[0].name])
    with pytest.raises(coverage.IdleFeatureError, match="registered no patch"):
        coverage.refuse_idle([Silent()], PatchRegistry(), ctx)


def test_fix_names_a_release_that_has_the_patches():
    assert coverage.fix_for([">=0.16,<0.17"], "--x").startswith("install megatron-core 0.16 (`pip install "
                                                               "'megatron-core>=0.16,<0.17'`)")
    newest = max(coverage.supported_minors())
    assert f"install megatron-core {newest}" in coverage.fix_for([">=0.12"], "--x")
    assert coverage.fix_for(["<0.1"], "--x") == "no supported megatron-core has them: drop --x"
