"""A stand-in `torch.npu` per release: exactly the names the wheel's `torch_npu/npu` exports.

`torch_npu.npu.__all__` (read from the wheel) decides what exists: any other name is an
AttributeError, as on an NPU host of that release. Streams and events have exactly the methods
the wheel's classes define, and their constructors the wheel's keywords. What a name does is a
CPU equivalent (one in-order stream, torch's CPU generator, zero cached bytes); a name the tier
does not model raises when called, so a path that reaches it shows up instead of passing.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import types

import torch

from npu_contract import wheel

INIT, STREAMS = "torch_npu/npu/__init__.py", "torch_npu/npu/streams.py"


@functools.lru_cache(maxsize=None)
def exported(release: str) -> tuple[str, ...]:
    tree = ast.parse((wheel.files(release) / INIT).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__":
            return tuple(ast.literal_eval(node.value))
    raise AssertionError(f"torch_npu {release}: no __all__ in {INIT}")


@functools.lru_cache(maxsize=None)
def classes(release: str) -> dict[str, tuple[set[str], set[str]]]:
    """Stream/Event class -> (method names, constructor keyword names), from the wheel."""
    found = {}
    for node in ast.parse((wheel.files(release) / STREAMS).read_text()).body:
        if isinstance(node, ast.ClassDef):
            methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
            new = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__new__"), None)
            keywords = {a.arg for a in (new.args.args[1:] + new.args.kwonlyargs)} if new else set()
            found[node.name] = (methods, keywords)
    return found


class _Base:
    """One in-order stream on the host: waits and records are already satisfied."""

    def wait_event(self, event): return None
    def wait_stream(self, stream): return None
    def record_event(self, event=None): return event if event is not None else self._event()
    def query(self): return True
    def synchronize(self): return None
    def record(self, stream=None): return None
    def wait(self, stream=None): return None
    def elapsed_time(self, other): return 0.0


def _make_class(release, name):
    methods, keywords = classes(release)[name]

    def __init__(self, *args, **kwargs):
        unknown = set(kwargs) - keywords
        if unknown:
            raise TypeError(f"torch_npu {release} torch.npu.{name}() got unexpected keyword(s) {sorted(unknown)}")

    body = {"__init__": __init__, "_event": lambda self: event_cls()}
    for method in methods - {"__new__", "__init__", "__eq__", "__hash__", "__repr__", "_as_parameter_"}:
        impl = getattr(_Base, method, None)
        body[method] = impl if impl is not None else _unmodelled(f"{name}.{method}")
    cls = type(name, (), body)
    event_cls = _make_class(release, "Event") if name != "Event" else cls
    return cls


def _unmodelled(what):
    def call(*args, **kwargs):
        raise NotImplementedError(f"torch.npu.{what} is not modelled by the NPU contract tier")
    return call


def module(release: str) -> types.ModuleType:
    """The stand-in `torch.npu` of `release`."""
    mod = types.ModuleType("torch.npu")
    stream_cls, event_cls = _make_class(release, "Stream"), _make_class(release, "Event")
    current = stream_cls()
    cpu = {
        "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
        "set_device": lambda device: None, "synchronize": lambda device=None: None,
        "get_device_name": lambda device=None: f"contract stand-in (torch_npu {release})",
        "Stream": stream_cls, "Event": event_cls,
        "current_stream": lambda device=None: current, "default_stream": lambda device=None: current,
        "stream": lambda s: contextlib.nullcontext(s),
        "get_rng_state": lambda device="npu": torch.get_rng_state(),
        "set_rng_state": lambda state, device="npu": torch.set_rng_state(state),
        "manual_seed": torch.manual_seed, "manual_seed_all": torch.manual_seed,
        "memory_allocated": lambda device=None: 0, "max_memory_allocated": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None, "memory_reserved": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: 0, "empty_cache": lambda: None,
        "memory_stats": lambda device=None: {}, "is_bf16_supported": lambda: True,
    }
    for name in exported(release):
        setattr(mod, name, cpu.get(name) or _unmodelled(name))
    return mod
