"""DESIGN's one-way rule: dependencies inside npuspeed/ point down, and there is no cycle.

Every import statement counts, also the ones inside functions (a lazy import is still a
dependency). Layers, bottom to top: the leaf modules (patching, ops, telemetry, arguments, errors,
megatron_flags, context, memory, plan_vocabulary, compute_floor, step_profile), then accelerator,
then features, then runtime, then the entry points (the package itself, megatron_adaptor, cli, reporting, plan, convert).
"""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "npuspeed"

LAYERS = {
    0: {"patching", "ops", "telemetry", "arguments", "megatron_flags", "context", "memory", "_version", "errors",
        "throughput", "plan_vocabulary", "compute_floor", "step_profile"},
    1: {"accelerator"},
    2: {"features"},
    3: {"runtime"},
    4: {"__init__", "megatron_adaptor", "cli", "reporting", "plan", "convert"},
}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """npuspeed modules that `name` imports (resolved to modules that exist)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "npuspeed"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "npuspeed":
                continue
            for alias in node.names:  # `from npuspeed import runtime` names a module
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in known else module)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


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
