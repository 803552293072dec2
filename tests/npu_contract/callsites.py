"""Every torch_npu op call in npuspeed's source, bound statically to each release's schema.

The stand-in catches a bad call when a test runs it; this reads the source, so a call no test
reaches is checked too: keywords the schema lacks, more positional arguments than precede its
`*`, missing required arguments, and results unpacked (`a, b = op(...)`) or indexed
(`op(...)[i]`) past the op's outputs. Each problem names the file, line, op and argument.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "npuspeed"


@dataclass
class CallSite:
    where: str  # file:line
    op: str
    positional: int  # -1: *args (not counted)
    keywords: list[str]
    unpacked: int | None = None  # a, b, c = op(...): 3
    starred: bool = False  # a, *rest = op(...)
    indexed: list[int] = field(default_factory=list)  # op(...)[i]


def _parents(tree):
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child._parent = node  # noqa: SLF001


def is_npu_op(name: str) -> bool:
    """torch_npu's own ops (the yaml also lists aten ops it overrides: clone, matmul, ...)."""
    return name.startswith(("npu_", "_npu_"))


def find(op_names, source: str, filename: str = "<source>") -> list[CallSite]:
    """The calls `<anything>.<op>(...)` of `source` whose attribute is one of `op_names` (None:
    any torch_npu-style name, npu_* / _npu_*)."""
    tree = ast.parse(source)
    _parents(tree)
    sites = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and (op_names is None or node.func.attr in op_names) and is_npu_op(node.func.attr)):
            continue
        starred_args = any(isinstance(a, ast.Starred) for a in node.args)
        site = CallSite(f"{filename}:{node.lineno}", node.func.attr,
                        -1 if starred_args else len(node.args), [k.arg for k in node.keywords if k.arg])
        parent = getattr(node, "_parent", None)
        if isinstance(parent, ast.Assign) and isinstance(parent.targets[0], ast.Tuple):
            elts = parent.targets[0].elts
            site.starred = any(isinstance(e, ast.Starred) for e in elts)
            site.unpacked = len(elts) - (1 if site.starred else 0)
        if isinstance(parent, ast.Subscript) and isinstance(parent.slice, ast.Constant):
            site.indexed.append(parent.slice.value)
        sites.append(site)
    return sites


def source_sites(op_names) -> list[CallSite]:
    sites = []
    for path in sorted(PACKAGE.rglob("*.py")):
        sites += find(op_names, path.read_text(), str(path.relative_to(ROOT)))
    return sites


def problems(site: CallSite, schema_text: str, release: str) -> list[str]:
    """What in `site` the schema of `release` does not take (empty: it binds)."""
    schema = torch._C.parse_schema(schema_text)
    head = f"{site.where}: torch_npu {release} {site.op}"
    args = schema.arguments
    positional = [a for a in args if not a.kwarg_only]
    names = {a.name for a in args}
    found = []
    for name in site.keywords:
        if name not in names:
            found.append(f"{head}: unknown keyword argument {name!r}")
    if site.positional > len(positional):
        extra = args[len(positional)] if len(positional) < len(args) else None
        found.append(f"{head}: {site.positional} positional arguments, the schema takes {len(positional)}"
                     + (f" (the next, {extra.name!r}, is keyword-only)" if extra is not None else ""))
    if site.positional >= 0:
        given = {a.name for a in positional[:site.positional]} | set(site.keywords)
        for arg in args:
            if not arg.has_default_value() and arg.name not in given and not str(arg.type).endswith("?"):
                found.append(f"{head}: required argument {arg.name!r} not given")
    outputs = len(schema.returns)
    if len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor[]":
        outputs = None  # a list: its length is the call's, not the schema's
    if outputs is not None and site.unpacked is not None:
        if (site.starred and site.unpacked > outputs) or (not site.starred and site.unpacked != outputs):
            found.append(f"{head}: result unpacked into {site.unpacked}{'+' if site.starred else ''} "
                         f"names, the op returns {outputs}")
    for index in site.indexed:
        if outputs is not None and outputs > 1 and index >= outputs:
            found.append(f"{head}: result indexed [{index}], the op returns {outputs}")
    return found
