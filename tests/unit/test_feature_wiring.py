"""Issue 49: one explicit wiring. A feature class names its patches and plan modules in its class
statement (`class XFeature(Feature, name="x", Config=Config, patches=_patches, plan=_plan)`, the
modules imported in its own <name>_feature.py: a reader and an IDE follow them), the base class calls `patches.register(registry, ctx, config, feature)` and
`plan.effect(model, config)` (one signature), `plan = None` is the one way to say "no plan
effect", and the class is named after its folder."""
from __future__ import annotations

import inspect
import types
from pathlib import Path

import pytest

FEATURES = Path(__file__).resolve().parents[2] / "npuspeed" / "features"
#: the features whose register_patches hands the patches the per-shape chooser their report reads
CHOOSER_HANDED = {"fused_linear_ce", "grad_accum_fusion"}


def _features():
    from npuspeed.features import all_features

    return {f.name: f for f in all_features()}


def class_name(folder: str) -> str:
    """The class a folder's feature is named: the folder in CamelCase + "Feature" (compared without
    case, so an acronym may be upper-cased: FusedRMSNormFeature, DualPipeVFeature)."""
    return "".join(part.capitalize() for part in folder.split("_")) + "Feature"


def wiring_problems(feature) -> list[str]:
    """What keeps `feature` from the one wiring (empty when it has it)."""
    from npuspeed.features.base import Feature

    cls, name = type(feature), feature.name
    problems = []
    if cls.__name__.lower() != class_name(name).lower():
        problems.append(f"class {cls.__name__} is not named after its folder ({class_name(name)})")
    for leaf, function, params in (("patches", "register", ["registry", "ctx", "config", "feature"]),
                                   ("plan", "effect", ["model", "config"])):
        if not any(leaf in vars(k) for k in cls.__mro__ if k is not Feature):
            problems.append(f"{leaf} is not said in the class (give it {leaf} = <its {leaf} module> or None)")
            continue
        module = getattr(feature, leaf)
        if module is None:
            if (FEATURES / name / f"{leaf}.py").is_file():
                problems.append(f"{leaf} = None, but {name}/{leaf}.py exists")
            continue
        if not isinstance(module, types.ModuleType) or module.__name__ != f"npuspeed.features.{name}.{leaf}":
            problems.append(f"{leaf} is {module!r}, not the module npuspeed.features.{name}.{leaf}")
            continue
        got = list(inspect.signature(getattr(module, function)).parameters)
        extra_ok = leaf == "patches" and name in CHOOSER_HANDED
        if got != params and not (extra_ok and got[:len(params)] == params):
            problems.append(f"{leaf}.{function}{tuple(got)}: the one signature is {function}({', '.join(params)})")
    if cls.plan_effect is not Feature.plan_effect:
        problems.append("overrides plan_effect (the base calls plan.effect(model, config))")
    if cls.register_patches is not Feature.register_patches and name not in CHOOSER_HANDED:
        problems.append("overrides register_patches (the base calls patches.register(registry, ctx, config, name))")
    return problems


@pytest.mark.parametrize("name", sorted(_features()))
def test_feature_has_the_one_wiring(name):
    problems = wiring_problems(_features()[name])
    assert problems == [], f"{name}: " + "; ".join(problems)


def test_no_lookup_by_name_is_left():
    """Nothing finds a feature's modules by a naming convention (importlib, _own_module)."""
    assert "importlib" not in (FEATURES / "base.py").read_text()
    for path in FEATURES.rglob("*.py"):
        text = path.read_text()
        for old in ("_own_module", "plan_neutral", "patches_module", "plan_module", 'import_module(f"npuspeed.features'):
            assert old not in text, (path, old)


def test_the_checker_catches_a_feature_wired_another_way():
    """The checker is shown to catch each kind of violation."""
    from npuspeed.features.base import Feature
    from npuspeed.features.recompute_norm import patches as _patches, plan as _plan

    class NormRecompute(Feature, name="recompute_norm", patches=_patches):  # not named after its folder, plan not said
        pass

    assert any("not named after its folder" in p for p in wiring_problems(NormRecompute()))
    assert any("plan is not said" in p for p in wiring_problems(NormRecompute()))

    class RecomputeNormFeature(Feature, name="recompute_norm", patches=_patches,  # another signature, an override
                               plan=types.SimpleNamespace(effect=lambda model, config, accelerator: None)):
        def plan_effect(self, model, ctx):
            return None

    found = wiring_problems(RecomputeNormFeature())
    assert any("not the module" in p for p in found) and any("overrides plan_effect" in p for p in found)

    class Other(Feature, name="recompute_norm", patches=_patches, plan=None):
        pass

    Other.__name__ = "RecomputeNormFeature"
    assert any("plan = None, but recompute_norm/plan.py exists" in p for p in wiring_problems(Other()))
    wrong = types.ModuleType("npuspeed.features.recompute_norm.plan")
    wrong.effect = lambda model, config, what: None
    Other.plan = wrong
    assert any("the one signature is effect(model, config)" in p for p in wiring_problems(Other()))
    Other.plan = _plan
    assert wiring_problems(Other()) == []


_WIRING = {"name", "Config", "patches", "plan"}


def test_each_feature_declares_its_wiring_in_its_class_statement():
    """name, Config, patches and plan are keywords of the class statement (a reader sees the wiring
    in one place), never assignments in its body."""
    import ast

    for name, feature in _features().items():
        declarable = {k for base in type(feature).__mro__[1:] for k, v in vars(base).items()
                      if not k.startswith("_") and not inspect.isroutine(v)}
        tree = ast.parse((FEATURES / name / f"{name}_feature.py").read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == type(feature).__name__)
        assert _WIRING <= {k.arg for k in cls.keywords}, (name, sorted(_WIRING - {k.arg for k in cls.keywords}))
        assigned = {t.id for st in cls.body if isinstance(st, ast.Assign) for target in st.targets
                    for t in ast.walk(target) if isinstance(t, ast.Name)}
        assert not assigned & declarable, (name, sorted(assigned & declarable))


def test_a_misspelt_class_keyword_is_refused():
    from npuspeed.features.base import Feature

    with pytest.raises(TypeError, match="swich is not a feature attribute"):
        class RecomputeNormFeature(Feature, name="recompute_norm", swich="recompute_norm"):
            pass
    with pytest.raises(TypeError, match="validate is not a feature attribute"):
        class RecomputeNormFeature(Feature, name="recompute_norm", validate=None):  # noqa: F811
            pass


def _alone(feature, option):
    """A context whose flags give only `option` (a value of its kind)."""
    import argparse

    spec = feature.Config.__dataclass_fields__
    arg = spec[option].metadata["argparse"]
    value = True if spec[option].default is False else arg["choices"][0] if "choices" in arg else \
        {int: 2, float: 1.0}.get(arg.get("type"), "mlp")
    return types.SimpleNamespace(args=argparse.Namespace(**{option: value}), accelerator=None, note=print,
                                 megatron=types.SimpleNamespace(), argv=()), value


def test_an_option_given_without_the_flag_it_requires_is_refused_in_one_message():
    """`requires` replaces the copied enabled()/validate blocks: the option alone turns the feature
    on, and validate refuses it naming both flags and the fix."""
    from npuspeed.features.base import FeatureError

    checked = 0
    for feature in _features().values():
        for option, needed in feature.requires.items():
            fields = feature.Config.__dataclass_fields__
            flag, main = (fields[f].metadata["argparse"]["flag"] for f in (option, needed))
            ctx, value = _alone(feature, option)
            assert feature.enabled(ctx.args), (feature.name, option)
            given = flag if value is True else f"{flag} {value}"
            with pytest.raises(FeatureError, match=f"^{given} is given without {main}; add {main} \\(or drop {flag}\\)$"):
                feature.validate(ctx)
            checked += 1
    assert checked >= 12
