"""The patch registry's contract, on throwaway modules and fresh registries.

Each test builds its own `PatchRegistry()` and its own modules (inserted into sys.modules
and removed after), so nothing here touches Megatron or the process-wide registry.
"""
from __future__ import annotations

import itertools
import math
import sys
import types

import pytest

from npuspeed.patching import PatchError, PatchRegistry
from npuspeed.patching.versions import megatron_version

_counter = itertools.count()


@pytest.fixture
def reg():
    registry = PatchRegistry()
    yield registry
    registry.clear()


@pytest.fixture
def make_module():
    """make_module(**attrs) -> a fresh module in sys.modules (name in `.__name__`)."""
    made = []

    def make(prefix: str = "_npt_mod", **attrs):
        name = f"{prefix}{next(_counter)}"
        module = types.ModuleType(name)
        for key, value in attrs.items():
            if callable(value) and hasattr(value, "__module__") and not isinstance(value, type):
                try:
                    value.__module__ = name
                except (AttributeError, TypeError):
                    pass
            setattr(module, key, value)
        sys.modules[name] = module
        made.append(name)
        return module

    yield make
    for name in made:
        sys.modules.pop(name, None)


def _target_module(make_module):
    def f(x):
        return ("orig", x)

    return make_module(f=f)


def test_replacement_or_wrapper_must_be_explicit(reg, make_module):
    mod = _target_module(make_module)
    target = f"{mod.__name__}.f"
    with pytest.raises(PatchError, match="not both"):
        reg.register(target, lambda x: x, wrapper=lambda fn: fn, feature="feat")
    with pytest.raises(PatchError, match="feat"):
        reg.register(target, feature="feat")
    assert reg.report() == []


def test_kind_is_never_guessed_from_the_name(reg, make_module):
    """A replacement called `wrapper` is still a replacement (called with the args)."""
    mod = _target_module(make_module)

    def wrapper(x):
        return ("replaced", x)

    reg.register(f"{mod.__name__}.f", wrapper, feature="feat")
    reg.apply()
    assert mod.f(3) == ("replaced", 3)
    assert reg.report()[0]["kind"] == "replace"


def test_wrappers_compose_in_registration_order_after_replacement(reg, make_module):
    mod = _target_module(make_module)
    target = f"{mod.__name__}.f"
    calls = []

    def tagging(tag):
        def wrap(fn):
            def wrapped(x):
                calls.append(tag)
                return (tag, fn(x))

            return wrapped

        return wrap

    def replacement(x):
        calls.append("replacement")
        return ("replacement", x)

    reg.register(target, wrapper=tagging("w1"), feature="a")
    reg.register(target, replacement, feature="b")
    reg.register(target, wrapper=tagging("w2"), feature="c")
    reg.apply()
    assert mod.f(1) == ("w2", ("w1", ("replacement", 1)))
    assert calls == ["w2", "w1", "replacement"]
    assert reg.original(target)(1) == ("orig", 1)
    reg.revert()
    assert mod.f(1) == ("orig", 1)


def test_by_value_copies_rebound_and_restored(reg, make_module):
    mod = _target_module(make_module)
    original = mod.f
    user = make_module(prefix="_npt_user", f=original, alias=original)  # `from mod import f`
    in_torch = make_module(prefix="torch._npt_copy", f=original)
    in_npuspeed = make_module(prefix="npuspeed._npt_copy", f=original)

    def replacement(x):
        return ("new", x)

    reg.register(f"{mod.__name__}.f", replacement, feature="feat")
    reg.apply()
    assert mod.f is replacement
    assert user.f is replacement and user.alias is replacement
    assert user.f(2) == ("new", 2)
    # torch's and npuspeed's own references stay the real functions
    assert in_torch.f is original
    assert in_npuspeed.f is original
    reg.revert()
    assert mod.f is original and user.f is original and user.alias is original


def test_rebound_copy_overwritten_by_user_is_left_alone_on_revert(reg, make_module):
    mod = _target_module(make_module)
    original = mod.f
    user = make_module(prefix="_npt_user", f=original)
    reg.register(f"{mod.__name__}.f", wrapper=lambda fn: (lambda x: ("w", fn(x))), feature="feat")
    reg.apply()

    def mine(x):
        return "mine"

    user.f = mine
    reg.revert()
    assert user.f is mine
    assert mod.f is original


def test_apply_twice_is_a_noop(reg, make_module):
    mod = _target_module(make_module)
    user = make_module(prefix="_npt_user", f=mod.f)
    applied = []

    def wrap(fn):
        applied.append(fn)

        def wrapped(x):
            return ("w", fn(x))

        return wrapped

    reg.register(f"{mod.__name__}.f", wrapper=wrap, feature="feat")
    reg.apply()
    first = mod.f
    reg.apply()
    assert mod.f is first and user.f is first
    assert len(applied) == 1
    assert mod.f(0) == ("w", ("orig", 0))
    assert user.f(0) == ("w", ("orig", 0))


def test_late_wrapper_recomposes_without_double_wrapping(reg, make_module):
    mod = _target_module(make_module)
    original = mod.f
    user = make_module(prefix="_npt_user", f=original)
    target = f"{mod.__name__}.f"
    reg.register(target, wrapper=lambda fn: (lambda x: ("w1", fn(x))), feature="a")
    reg.apply()
    reg.register(target, wrapper=lambda fn: (lambda x: ("w2", fn(x))), feature="b")
    reg.apply()
    assert mod.f(0) == ("w2", ("w1", ("orig", 0)))
    assert user.f is mod.f
    assert reg.original(target) is original
    reg.revert()
    assert mod.f is original and user.f is original


def test_two_replacements_name_both_features(reg, make_module):
    mod = _target_module(make_module)
    target = f"{mod.__name__}.f"
    reg.register(target, lambda x: 1, feature="alpha")
    with pytest.raises(PatchError) as err:
        reg.register(target, lambda x: 2, feature="beta")
    assert "alpha" in str(err.value) and "beta" in str(err.value) and target in str(err.value)


class _Base:
    def inherited(self, x):
        return ("base", self.tag, x)

    @staticmethod
    def inherited_static(x):
        return ("base-static", x)

    @classmethod
    def inherited_cls(cls, x):
        return ("base-cls", cls.__name__, x)


class _Child(_Base):
    tag = "child"

    @staticmethod
    def stat(x):
        return ("static", x)

    @classmethod
    def klass(cls, x):
        return ("class", cls.__name__, x)


def _wrap_tag(fn):
    def wrapped(*args):
        return ("w", fn(*args))

    return wrapped


@pytest.mark.parametrize("kind", ["replace", "wrap"])
def test_descriptor_and_inherited_targets_survive_apply_and_revert(reg, make_module, kind):
    mod = make_module(Child=_Child)
    name = f"{mod.__name__}.Child"
    raw_before = dict(vars(_Child))
    obj = _Child()
    expected_plain = {
        "stat": ("static", 1),
        "klass": ("class", "_Child", 1),
        "inherited": ("base", "child", 1),
        "inherited_static": ("base-static", 1),
        "inherited_cls": ("base-cls", "_Child", 1),
    }
    if kind == "wrap":
        for attr in expected_plain:
            reg.register(f"{name}.{attr}", wrapper=_wrap_tag, feature="feat")
    else:
        reg.register(f"{name}.stat", lambda x: ("new-static", x), feature="feat")
        reg.register(f"{name}.klass", lambda cls, x: ("new-class", cls.__name__, x), feature="feat")
        reg.register(f"{name}.inherited", lambda self, x: ("new", self.tag, x), feature="feat")
        reg.register(f"{name}.inherited_static", lambda x: ("new-static", x), feature="feat")
        reg.register(f"{name}.inherited_cls", lambda cls, x: ("new-cls", cls.__name__, x), feature="feat")
    reg.apply()
    for attr, plain in expected_plain.items():
        # reached through the class and through an instance, as Megatron does
        for via in (obj,) if attr == "inherited" else (_Child, obj):
            got = getattr(via, attr)(1)
            if kind == "wrap":
                assert got == ("w", plain), (attr, via)
            else:
                assert got[0].startswith("new") and got[1:] == plain[1:], (attr, via, got)
    assert isinstance(vars(_Child)["stat"], staticmethod)
    assert isinstance(vars(_Child)["klass"], classmethod)
    reg.revert()
    assert dict(vars(_Child)) == raw_before
    for attr, plain in expected_plain.items():
        assert getattr(obj, attr)(1) == plain
    assert "inherited" not in vars(_Child)
    assert vars(_Base)["inherited_static"] is not None


def test_missing_target_names_feature_target_and_version(reg, make_module):
    mod = _target_module(make_module)
    target = f"{mod.__name__}.no_such_function"
    reg.register(target, lambda: None, feature="my-feature")
    with pytest.raises(PatchError) as err:
        reg.apply()
    message = str(err.value)
    assert "my-feature" in message and target in message
    assert str(megatron_version()) in message and "megatron-core" in message


def test_missing_module_target_is_a_patch_error(reg):
    target = "megatron.core._npuspeed_no_such_module.fn"
    reg.register(target, lambda: None, feature="my-feature")
    with pytest.raises(PatchError, match="my-feature"):
        reg.apply()


def test_version_range_excluding_installed_skips(reg, make_module):
    mod = _target_module(make_module)
    original = mod.f
    # the target of the skipped patch does not even exist: it must not be resolved
    reg.register(f"{mod.__name__}.f", lambda x: "new", feature="old", megatron="<0.12")
    reg.register(f"{mod.__name__}.gone", lambda: None, feature="old", megatron="<0.12")
    reg.apply()
    assert mod.f is original
    assert not reg.is_applied(f"{mod.__name__}.f")
    rows = reg.report()
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    assert all(str(megatron_version()) in r["reason"] and "<0.12" in r["reason"] for r in rows)


def test_report_lists_every_patch(reg, make_module):
    mod = make_module(f=lambda x: x, g=lambda x: x)
    reg.register(f"{mod.__name__}.f", lambda x: -x, feature="one")
    reg.register(f"{mod.__name__}.g", wrapper=_wrap_tag, feature="two", megatron=None)
    reg.register(f"{mod.__name__}.g", wrapper=_wrap_tag, feature="three", megatron="<0.1")
    assert [r["status"] for r in reg.report()] == ["registered"] * 3
    reg.apply()
    rows = reg.report()
    assert [(r["target"], r["feature"], r["kind"], r["status"]) for r in rows] == [
        (f"{mod.__name__}.f", "one", "replace", "applied"),
        (f"{mod.__name__}.g", "two", "wrap", "applied"),
        (f"{mod.__name__}.g", "three", "wrap", "skipped"),
    ]
    assert rows[2]["reason"]
    assert mod.g(5) == ("w", 5)  # the skipped wrapper did not stack
    reg.revert()
    assert [r["status"] for r in reg.report()][:2] == ["registered", "registered"]


def test_remove_feature_keeps_other_features(reg, make_module):
    def f(x):
        return ("f", x)

    def g(x):
        return ("g", x)

    def h(x):
        return ("h", x)

    mod = make_module(f=f, g=g, h=h)
    user = make_module(prefix="_npt_user", g=g)
    n = mod.__name__
    reg.register(f"{n}.f", lambda x: ("A", x), feature="A")
    reg.register(f"{n}.g", wrapper=lambda fn: (lambda x: ("wA", fn(x))), feature="A")
    reg.register(f"{n}.g", wrapper=lambda fn: (lambda x: ("wB", fn(x))), feature="B")
    reg.register(f"{n}.h", lambda x: ("B", x), feature="B")
    reg.apply()
    assert mod.g(0) == ("wB", ("wA", ("g", 0)))
    reg.remove("A")
    assert mod.f is f
    assert mod.g(0) == ("wB", ("g", 0))
    assert user.g(0) == ("wB", ("g", 0))
    assert mod.h(0) == ("B", 0)
    assert {r["feature"] for r in reg.report()} == {"B"}
    assert all(r["status"] == "applied" for r in reg.report())
    reg.remove("B")
    assert (mod.f, mod.g, mod.h, user.g) == (f, g, h, g)
    assert reg.report() == []


def test_marker_is_set(reg, make_module):
    mod = make_module(f=lambda x: x, b=math.floor)
    n = mod.__name__
    reg.register(f"{n}.f", wrapper=_wrap_tag, feature="feat")
    # a builtin replacement cannot carry attributes: it is wrapped to carry the marker
    reg.register(f"{n}.b", math.ceil, feature="feat")
    reg.apply()
    assert mod.f.__npuspeed_patch__ == f"{n}.f"
    assert mod.b.__npuspeed_patch__ == f"{n}.b"
    assert mod.b(1.5) == 2
    reg.revert()
    assert mod.b is math.floor and not hasattr(mod.f, "__npuspeed_patch__")


def test_if_missing_defines_only_absent_names(reg, make_module):
    mod = _target_module(make_module)
    original = mod.f
    n = mod.__name__
    reg.register(f"{n}.undefined", None, feature="feat", if_missing=True)  # a None value is allowed
    reg.register(f"{n}.f", lambda x: "new", feature="feat", if_missing=True)
    reg.apply()
    assert hasattr(mod, "undefined") and mod.undefined is None
    assert mod.f is original
    rows = {r["target"]: r for r in reg.report()}
    assert rows[f"{n}.undefined"]["status"] == "applied"
    assert rows[f"{n}.f"]["status"] == "skipped" and "already defined" in rows[f"{n}.f"]["reason"]
    reg.revert()
    assert not hasattr(mod, "undefined") and mod.f is original
    with pytest.raises(PatchError):  # if_missing provides a value; it cannot wrap
        reg.register(f"{n}.g", wrapper=_wrap_tag, feature="feat", if_missing=True)


_REVERT_PROBE = r"""
import importlib, inspect, json, sys, types
import torch, torch.distributed, torch.cuda.nvtx
import megatron.core
from npuspeed.features.device import megatron_fixes
# load every module the device feature touches, so the snapshot covers them
for target in megatron_fixes.DEVICE_REDIRECTS + megatron_fixes.SCHEDULES + [
        "tensor_parallel.random.x", "transformer.torch_norm.x", "transformer.moe.moe_utils.x"]:
    parts = ("megatron.core." + target).split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            importlib.import_module(".".join(parts[:i]))
            break
        except ModuleNotFoundError:
            pass

def watched():
    mods = {n: m for n, m in sys.modules.items() if m is not None and n.startswith("megatron.core")}
    mods.update({m.__name__: m for m in (torch.cuda, torch.distributed, torch.cuda.nvtx)})
    return mods

def snapshot(mods):
    snap = {}
    for name, mod in mods.items():
        snap[name] = dict(vars(mod))
        for attr, value in vars(mod).items():
            if inspect.isclass(value) and value.__module__ == name:
                snap[f"{name}:{attr}"] = (value, dict(vars(value)))
    return snap

def diff(before):
    out = []
    for key, saved in before.items():
        if ":" in key:
            cls, attrs = saved
            now = dict(vars(cls))
        else:
            attrs, now = saved, vars(sys.modules[key])
        for attr, value in attrs.items():
            if attr not in now or now[attr] is not value:
                out.append(f"{key}.{attr}")
        for attr in set(now) - set(attrs):
            if not isinstance(now[attr], types.ModuleType) and attr != "__warningregistry__":
                out.append(f"{key}.{attr} (added)")
    return out

mods = watched()
before = snapshot(mods)
from npuspeed import runtime
from npuspeed.patching import registry
runtime.initialize([])
applied = [p["target"] for p in registry.report() if p["status"] == "applied"]
during = diff(before)
cpu_device = str(torch.cuda.current_device())
runtime.reset()
after = diff(before)
print(json.dumps({"n_modules": len(mods), "applied": applied, "during": during, "after": after,
                  "cpu_device": cpu_device, "report_after": registry.report()}))
"""


def test_real_registry_revert_restores_megatron_exactly():
    import json
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _REVERT_PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["n_modules"] > 50
    assert "torch.cuda.current_device" in result["applied"]
    assert result["cpu_device"] == "cpu"
    # the device feature changed torch.cuda, torch.distributed and megatron.core ...
    during = set(result["during"])
    assert "torch.cuda.current_device" in during
    assert "torch.distributed.init_process_group" in during
    assert "megatron.core.tensor_parallel.random._set_cuda_rng_state" in during
    assert "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork" in during
    assert "megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__" in during
    assert len(during) >= len(set(result["applied"]))
    # ... and reset() put every one of them back, megatron.core exactly as imported, but for
    # what Python and Megatron fill in lazily whoever calls them (megatron-core 0.19: typing
    # gives a Protocol subclass its own __init__ at its first instantiation; get_te_version()
    # caches `_te_version`): no patch of npuspeed's
    lazy = {"megatron.core.models.backends:InferenceSpecProvider.__init__ (added)",
            "megatron.core.utils._te_version"}
    assert [name for name in result["after"] if name not in lazy] == []
    assert result["report_after"] == []
