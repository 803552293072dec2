"""Issue 35: a feature has one shape. Each feature lives in npuspeed/features/<name>/ (name =
folder) with <name>_feature.py (the class and its typed Config: one field per flag, the
docstring under it the flag's --help), patches.py and (unless `plan=None`: no plan effect)
plan.py beside the implementation, and reads its flags from the typed config, not with getattr.
Every feature has it (issue 35); how the class names those modules: test_feature_wiring.py."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

FEATURES = Path(__file__).resolve().parents[2] / "npuspeed" / "features"
SHAPE = ("{name}_feature.py", "patches.py", "plan.py")


def _features():
    from npuspeed.features import all_features

    return {f.name: f for f in all_features()}


def shape_problems(feature) -> list[str]:
    """What keeps `feature` from the one shape (empty when it has it)."""
    folder = FEATURES / feature.name
    problems = [f"no file {folder.name}/{f.format(name=feature.name)}" for f in SHAPE
                if not (folder / f.format(name=feature.name)).is_file() and (f != "plan.py" or feature.plan)]
    module = f"npuspeed.features.{feature.name}.{feature.name}_feature"
    if type(feature).__module__ != module:
        problems.append(f"class in {type(feature).__module__}, not {module}")
    if feature.Config is None or feature.Config.__module__ != module:
        problems.append(f"no typed Config in {module}")
    elif not set(feature.flags) <= set(feature.Config.flags()):  # (a Config may hold flags npuspeed sets)
        problems.append(f"flags {feature.flags} are not all its Config's {feature.Config.flags()}")
    return problems + getattr_reads(folder)


def getattr_reads(folder: Path) -> list[str]:
    """`getattr(<...>args, "flag", ...)` reads of flags in the folder's modules."""
    hits = []
    for path in sorted(folder.glob("*.py")) if folder.is_dir() else []:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                    and node.args and "args" in ast.unparse(node.args[0]):
                hits.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return hits


@pytest.mark.parametrize("name", sorted(_features()))
def test_feature_has_the_one_shape(name):
    problems = shape_problems(_features()[name])
    assert problems == [], f"{name}: " + "; ".join(problems)


def test_each_flags_owner_is_found_by_its_folder_name():
    """A flag's owner is the feature in npuspeed/features/<name>/<name>_feature.py."""
    for name, feature in _features().items():
        text = (FEATURES / name / f"{name}_feature.py").read_text()
        for flag in feature.flags:
            assert flag in text or flag.lstrip("-").replace("-", "_") in text, (name, flag)


def test_help_names_each_flags_module():
    from npuspeed import arguments

    lines = arguments.features_help(list(_features().values())).splitlines()
    line = next(line for line in lines if line.strip().startswith("recompute_norm "))
    assert "--recompute-norm" in line and "[npuspeed.features.recompute_norm.recompute_norm_feature]" in line


def test_a_flag_without_a_docstring_is_refused():
    import argparse
    from dataclasses import dataclass

    from npuspeed.features.config import FeatureConfig, flag

    @dataclass(frozen=True)
    class Bad(FeatureConfig):
        x: bool = flag("--x", False)

    with pytest.raises(TypeError, match="needs a docstring"):
        Bad.add_arguments(argparse.ArgumentParser())
