"""DESIGN's one-way rule: dependencies inside npuspeed/ point down, and there is no cycle; and
its shared-rooms rule: no feature folder imports another feature folder.

Every import statement counts, also the ones inside functions (a lazy import is still a
dependency). Layers, bottom to top: the leaf modules (patching, ops, telemetry, arguments, errors,
megatron_flags, context, memory, plan_vocabulary, offload, compute_floor, step_profile), then accelerator,
then features, then runtime, then the entry points (the package itself, megatron_adaptor, cli, reporting, run_report,
plan, convert, compare).
"""
from __future__ import annotations

import ast
import functools
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "npuspeed"

LAYERS = {
    0: {"patching", "ops", "telemetry", "arguments", "megatron_flags", "context", "memory", "_version", "errors",
        "throughput", "plan_vocabulary", "offload", "compute_floor", "step_profile"},
    1: {"accelerator"},
    2: {"features"},
    3: {"runtime"},
    4: {"__init__", "megatron_adaptor", "cli", "reporting", "run_report", "plan", "convert", "compare"},
}


def _module_name(path: pathlib.Path, package: pathlib.Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(package: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
    return {_module_name(p, package): p for p in package.rglob("*.py")}


def _imports(name: str, path: pathlib.Path, known: set[str], root: str = "npuspeed") -> set[str]:
    """npuspeed modules (`root`'s) that `name` imports (resolved to modules that exist)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == root}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != root:
                continue
            for alias in node.names:  # `from npuspeed import runtime` names a module
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in known else module)
    return {m for m in found if m in known and m != name}


@functools.lru_cache(maxsize=4)
def _graph(package: pathlib.Path) -> dict[str, frozenset[str]]:
    modules = _modules(package)
    known = set(modules)
    return {name: frozenset(_imports(name, path, known, package.name)) for name, path in modules.items()}


def graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """Each module's npuspeed imports (read once per test session and tree)."""
    return {name: set(deps) for name, deps in _graph(package).items()}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(module: str) -> int:
    unit = _unit(module)
    for level, units in LAYERS.items():
        if unit in units:
            return level
    raise AssertionError(f"{module}: unit {unit!r} has no layer in this test; add it to LAYERS")


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_checker_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_module_imports_a_higher_layer():
    wrong = [f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
             for m, deps in graph().items() for d in deps if _layer(d) > _layer(m)]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_modules():
    assert _cycle(graph()) is None, " -> ".join(_cycle(graph()))


def test_no_feature_imports_runtime_or_arguments():
    wrong = [f"{m} imports {d}" for m, deps in graph().items() if _unit(m) == "features"
             for d in deps if _unit(d) in ("runtime", "arguments")]
    assert not wrong, "\n".join(wrong)


def test_the_graph_sees_lazy_imports():
    edges = graph()
    assert "npuspeed.features" in edges["npuspeed.runtime"]  # imported inside initialize()
    assert "npuspeed.telemetry" in edges["npuspeed.ops._dispatch"]


# --- feature folders are boundaries (docs/design.md, "Shared rooms") ----------------------------

#: Imports from one feature folder into another that are still to move to a shared room, each
#: (importer, imported module): why it is there and where it should go. The list only shrinks: an
#: entry that no longer occurs fails too, so it is removed when its import is. Empty since issue 49:
#: the CUDA-call mapping moved to cuda_mapping/, "who frees what" to freed_outputs.py, and the
#: swap reads the other features' flags as fields of its own typed Config.
KNOWN: dict[tuple[str, str], str] = {}


def feature_folders(package: pathlib.Path = PACKAGE) -> set[str]:
    """The folders of features/ that define a feature: they hold `<folder>_feature.py`."""
    return {d.name for d in (package / "features").iterdir() if (d / f"{d.name}_feature.py").is_file()}


def _folder(module: str, folders: set[str]) -> str | None:
    """The feature folder a module is in (None: a shared room)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "features" and parts[2] in folders else None


def folder_crossings(package: pathlib.Path = PACKAGE) -> list[tuple[str, str, str]]:
    """(importer, imported module, the rule broken) for every import under features/ that enters a
    feature folder from outside it: from another feature folder, or from a shared room of
    features/ (its top-level modules, moe_common/, pipeline/, attention/). Only the package's face,
    features/__init__.py, lists the features."""
    folders = feature_folders(package)
    name = package.name
    wrong = []
    for module, deps in sorted(graph(package).items()):
        if not module.startswith(f"{name}.features."):
            continue
        mine = _folder(module, folders)
        for dep in sorted(deps):
            theirs = _folder(dep, folders)
            if theirs is None or theirs == mine:
                continue
            rule = (f"feature folder {mine}/ imports feature folder {theirs}/" if mine else
                    f"shared room {module} imports feature folder {theirs}/")
            wrong.append((module, dep, rule + ": move what both use to a shared room (features/pipeline/, "
                          "features/attention/, moe_common/, a module at features/'s top level, or a package "
                          "outside features/) and import it from there; another feature's flag is a field of the "
                          "importer's own Config without flag(...)"))
    return wrong


def test_no_feature_folder_imports_another():
    found = folder_crossings()
    new = [f"{m} imports {d} ({rule})" for m, d, rule in found if (m, d) not in KNOWN]
    assert not new, "\n".join(new)
    gone = sorted(set(KNOWN) - {(m, d) for m, d, _ in found})
    assert not gone, f"these imports are gone: remove them from KNOWN: {gone}"


def test_no_import_cycle_between_feature_folders():
    folders = feature_folders()
    edges: dict[str, set[str]] = {}
    for module, deps in graph().items():
        mine = _folder(module, folders)
        if mine:
            edges.setdefault(mine, set()).update(d for d in map(lambda x: _folder(x, folders), deps) if d and d != mine)
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def _tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_folder_check_catches_a_crossing(tmp_path):
    """A fake tree: feature a imports feature b's internals (absolutely and relatively), a shared
    room imports feature b; the face lists both; a imports the shared room and its own modules."""
    package = _tree(tmp_path, {
        "__init__.py": "",
        "features/__init__.py": "from pkg.features.a import a_feature\nfrom pkg.features.b import b_feature\n",
        "features/shared/__init__.py": "",
        "features/shared/room.py": "def f():\n    from pkg.features.b import inner\n",
        "features/a/__init__.py": "",
        "features/a/a_feature.py": "from pkg.features.shared import room\nfrom pkg.features.a import own\n",
        "features/a/own.py": "from ..b.inner import g\n",
        "features/b/__init__.py": "",
        "features/b/b_feature.py": "from . import inner\n",
        "features/b/inner.py": "def g():\n    pass\n",
    })
    assert feature_folders(package) == {"a", "b"}
    found = {(m, d): rule for m, d, rule in folder_crossings(package)}
    assert set(found) == {("pkg.features.a.own", "pkg.features.b.inner"),
                          ("pkg.features.shared.room", "pkg.features.b.inner")}
    assert found[("pkg.features.a.own", "pkg.features.b.inner")].startswith("feature folder a/ imports feature "
                                                                            "folder b/")
    assert found[("pkg.features.shared.room", "pkg.features.b.inner")].startswith("shared room pkg.features."
                                                                                  "shared.room imports")
