"""A feature's typed flags: a frozen dataclass, one field per flag, the docstring under each
field is the flag's --help, and the argparse group is generated from it.

    @dataclass(frozen=True)
    class Config(FeatureConfig):
        recompute_norm: bool = flag("--recompute-norm", False)
        \"\"\"Free the norms' outputs once the next linear has used them; recompute in backward.\"\"\"

Features read `self.config(ctx.args).recompute_norm` instead of `getattr(args, "x", None)`: a
namespace without the feature's flags (another parser, a test) gives the defaults, and a typo in
a field name is an AttributeError, not a silent None.
"""
from __future__ import annotations

import argparse
import ast
import functools
import inspect
import textwrap
from dataclasses import MISSING, dataclass, field, fields


def flag(name: str, default=None, *, type=None, choices=None, metavar: str | None = None,  # noqa: A002
         action: str | None = None, nargs=None):
    """A Config field that is the command-line flag `name` (argparse's keywords; a bool field
    with default False is a store_true switch)."""
    spec = {"flag": name, "type": type, "choices": choices, "metavar": metavar, "action": action, "nargs": nargs}
    return field(default=default, metadata={"argparse": {k: v for k, v in spec.items() if v is not None}})


@functools.lru_cache(maxsize=None)
def field_docs(cls) -> dict[str, str]:
    """{field: the docstring right under it} from the class's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


@dataclass(frozen=True)
class FeatureConfig:
    """Base of the features' Config classes (see the module docstring)."""

    @classmethod
    def flag_fields(cls):
        return [f for f in fields(cls) if "argparse" in f.metadata]

    @classmethod
    def flags(cls) -> tuple[str, ...]:
        return tuple(f.metadata["argparse"]["flag"] for f in cls.flag_fields())

    @classmethod
    def add_arguments(cls, group: argparse._ArgumentGroup) -> None:
        docs = field_docs(cls)
        for f in cls.flag_fields():
            spec = dict(f.metadata["argparse"])
            name = spec.pop("flag")
            if docs.get(f.name) is None:
                raise TypeError(f"{cls.__module__}.{cls.__qualname__}.{f.name}: a flag needs a docstring under it")
            if f.default is False and "action" not in spec:
                spec["action"] = "store_true"
            default = None if f.default is MISSING else f.default
            group.add_argument(name, dest=f.name, default=default, help=docs[f.name], **spec)

    @classmethod
    def from_args(cls, args: argparse.Namespace):
        """The typed flags of `args` (defaults for what it does not hold)."""
        return cls(**{f.name: getattr(args, f.name, f.default) for f in fields(cls) if f.init})
