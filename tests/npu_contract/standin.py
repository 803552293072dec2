"""A stand-in `torch_npu` per release: the wheel's schemas, its meta functions, our emulators.

Each op npuspeed calls is defined with `torch.library` under the release's own schema (in a
namespace of its own, `tnpu_2_14_0`, so releases coexist in one process), so a call binds as it
would on an NPU: unknown keywords, positional arguments past `*` and missing arguments fail in
the dispatcher with the op named. Its CPU kernel (`_Kernel`) runs the emulator and checks every
output against the wheel's meta function for the same inputs: count, shapes, dtypes. Ops that
torch_npu differentiates get autograd through the emulator (numerics: the emulator's).

CPU tensors play NPU tensors (on_host.py): npuspeed's NPU branches run on them.
"""
from __future__ import annotations

import functools
import inspect
import types

import torch

from npu_contract import autograd, wheel, wheel_contract

#: forward ops torch_npu gives autograd to (their grads come from the emulators here)
DIFFERENTIABLE = ("npu_rms_norm", "npu_swiglu", "npu_rotary_mul", "npu_fusion_attention",
                  "npu_moe_token_permute_with_routing_map", "npu_moe_token_unpermute_with_routing_map")


#: (release, op, input_layout) whose meta function in that wheel is wrong, so the newest
#: release's is used: 2.6.0's and 2.9.0's read TND's softmax_max/sum as BNSD ([T, N, D, 8];
#: 2.14.0: [T, N, 8], the documented shape), 2.6.0's BSND ones as [B, N, N, 8] ([B, N, S, 8])
META_ERRATA = {("2.6.0", "npu_fusion_attention", "TND"), ("2.9.0", "npu_fusion_attention", "TND"),
               ("2.6.0", "npu_fusion_attention", "BSND")}


class ContractError(AssertionError):
    """An emulator's output disagrees with the wheel's meta function, or a call needs what the
    emulator does not model."""


@functools.lru_cache(maxsize=None)
def contract(release: str):
    """(schemas, meta functions) of torch_npu `release`, ATB ops included."""
    root = wheel.files(release)
    schemas = dict(wheel_contract.schemas(root))
    schemas.update(wheel_contract.atb_schemas(root))
    return schemas, wheel_contract.meta_functions(root, meta_stub())


def meta_stub() -> types.ModuleType:
    """torch_npu as its meta functions read it at definition: its own dtype names."""
    stub = types.ModuleType("torch_npu")
    for name in ("hifloat8", "float8_e8m0fnu", "float4_e2m1fn_x2", "float4_e1m2fn_x2", "int4"):
        setattr(stub, name, object())
    return stub


def namespace(release: str) -> str:
    return "tnpu_" + release.replace(".", "_")


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to("meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    return value


def bind(schema, args, kwargs) -> dict:
    """Every schema argument by name, defaults filled (the dispatcher already refused a bad call)."""
    bound = {}
    positional = [a for a in schema.arguments if not a.kwarg_only]
    for arg, value in zip(positional, args):
        bound[arg.name] = value
    for arg in schema.arguments:
        if arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.name not in bound:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return bound


def _split(schema, bound):
    args = [bound[a.name] for a in schema.arguments if not a.kwarg_only]
    return args, {a.name: bound[a.name] for a in schema.arguments if a.kwarg_only}


class _Kernel:
    """The CPU kernel of one op: the emulator, its outputs held to the meta function's."""

    def __init__(self, release, name, emulator, meta, calls, log=None, outputs=None):
        self.release, self.name, self.emulator, self.meta, self.calls = release, name, emulator, meta, calls
        self.log = log  # (op, every argument by name) per call, for tests of the marshalling
        self.outputs = outputs  # op -> its last call's outputs
        self.declared = set(inspect.signature(emulator).parameters)

    @property
    def schema(self):
        return getattr(getattr(torch.ops, namespace(self.release)), self.name).default._schema

    def __call__(self, *args, **kwargs):
        schema = self.schema
        bound = bind(schema, args, kwargs)
        self.calls[self.name] = self.calls.get(self.name, 0) + 1
        if self.log is not None:
            self.log.append((self.name, bound))
        for arg in schema.arguments:
            if arg.name in self.declared:
                continue
            default = arg.default_value if arg.has_default_value() else None
            if bound[arg.name] is not None and bound[arg.name] != default:
                raise ContractError(f"torch_npu {self.release} {self.name}: the emulator does not model "
                                    f"{arg.name}={bound[arg.name]!r}")
        expected = None
        meta = self.meta
        if (self.release, self.name, bound.get("input_layout")) in META_ERRATA:
            meta = contract(wheel.RELEASES[-1])[1][self.name]
        if meta is not None:
            meta_args, meta_kwargs = _split(schema, {k: _to_meta(v) for k, v in bound.items()})
            expected = meta(*meta_args, **meta_kwargs)
        out = self.emulator(**{k: v for k, v in bound.items() if k in self.declared})
        out = self._checked(schema, out, expected)
        if self.outputs is not None:
            self.outputs[self.name] = out
        return out

    def _checked(self, schema, out, expected):
        returns = schema.returns
        if not returns:
            return None
        if len(returns) == 1 and str(returns[0].type) != "Tensor[]":
            got, want = [out], [expected]
        elif str(returns[0].type) == "Tensor[]":
            got, want = [list(out)], [expected]
        else:
            got, want = list(out), list(expected) if expected is not None else [None] * len(returns)
            # outputs the emulator does not compute (e.g. 2.14's dsink) are zeros of the meta shape
            while len(got) < len(returns) and expected is not None and isinstance(want[len(got)], torch.Tensor):
                meta = want[len(got)]
                got.append(torch.zeros(meta.shape, dtype=meta.dtype))
        if len(got) != len(returns):
            raise ContractError(f"torch_npu {self.release} {self.name}: the emulator returned {len(got)} "
                                f"outputs, the schema {len(returns)}")
        for i, (g, w) in enumerate(zip(got, want)):
            _same(self.release, self.name, i, g, w)
        return got[0] if len(returns) == 1 else tuple(got)


def _same(release, name, index, got, want):
    if want is None:
        return
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            raise ContractError(f"torch_npu {release} {name} output {index}: {type(got).__name__} of "
                                f"{len(got) if isinstance(got, (list, tuple)) else '-'}, meta {len(want)}")
        for g, w in zip(got, want):
            _same(release, name, index, g, w)
        return
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise ContractError(
                f"torch_npu {release} {name} output {index}: emulator "
                f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__} "
                f"{getattr(got, 'dtype', '')}, meta function {tuple(want.shape)} {want.dtype}")


class Release:
    """One torch_npu release's ops, defined once per process (torch.library cannot redefine)."""

    def __init__(self, release: str, emulators: dict):
        schemas, metas = contract(release)
        self.release, self.calls, self.log, self.outputs = release, {}, [], {}
        self.missing_meta: list[str] = []
        self.ops: dict[str, object] = {}
        ns = namespace(release)
        self.library = torch.library.Library(ns, "DEF")
        for name, emulator in emulators.items():
            if name not in schemas:
                continue  # this release has no such op: npuspeed must find it absent
            self.library.define(schemas[name])
            meta = metas.get(name)
            if meta is None:
                self.missing_meta.append(name)
            kernel = _Kernel(release, name, emulator, meta, self.calls, self.log, self.outputs)
            self.library.impl(name, kernel, "CPU")
            self.ops[name] = getattr(getattr(torch.ops, ns), name)
            if name in DIFFERENTIABLE:
                self.library.impl(name, autograd.kernel(release, kernel, self.ops[name]), "Autograd")


@functools.lru_cache(maxsize=None)
def release(version: str) -> Release:
    from npu_contract.emulators import all_emulators

    return Release(version, all_emulators(version))


def module(version: str, *, nnal: bool = True) -> types.ModuleType:
    """A `torch_npu` module of `version`: its ops as attributes, as torch_npu exposes them.

    nnal=False: the ATB/NNAL package is missing; torch_npu's lazy ATB wrapper then exists but
    raises OSError when called (op_plugin/atb/_atb_ops.py), and so does this one."""
    rel = release(version)
    mod = types.ModuleType("torch_npu")
    mod.__version__ = version
    for name, op in rel.ops.items():
        setattr(mod, name, op)
    if not nnal and "_npu_matmul_add_fp32" in rel.ops:
        def missing(*args, **kwargs):
            raise OSError("libatb.so: cannot open shared object file: No such file or directory. "
                          "Please check that the nnal package is installed.")
        mod._npu_matmul_add_fp32 = missing
    return mod
