"""Which implementation a fused-op flag runs: the fastest correct one, measured once per shape.

`--use-fused-rmsnorm`, `--use-fused-swiglu`, `--use-fused-rotary-pos-emb` (and the MoE ops)
each hand `Chooser.pick` their candidates for one call: the device's native op (`npu`:
torch_npu's fused kernel; `native`: torch's own where it differs from Megatron's), npuspeed's
kernel (`cpp` on CPU, `triton` on CUDA/NPU when importable), `compile` (torch.compile of the
same function Megatron runs: `compiled`, on accelerators unless NPUSPEED_FUSED_OP_COMPILE says
otherwise), `liger` (Liger-Kernel's kernel where `liger_kernel` imports: `liger`) and
`megatron`, the path that runs with the flag off. A first call's compile or JIT is never a
timing sample (npuspeed.ops.choose.measure keeps it apart as `first_ms`). Per key (op, device type, dtype, shapes, options) every candidate runs
forward + backward on detached copies of the call's inputs: one warm-up round (which also
checks its output against Megatron's and drops a candidate that disagrees or raises), then
`repeats` interleaved timed rounds; the fastest minimum wins, ties go to `megatron`, so a flag
is never slower than off by more than the noise of the measurement. The choice is cached.
The rule itself is npuspeed.ops.choose (one chooser for every feature); this module is the
fused ops' front end: their candidates, forcing variable and kernel lookup.

Trial calls are not counted (`_dispatch.quiet`), the random states are put back, and so are
the memory peaks on CPU (`Guard`; the feature installs one that knows the accelerator and
Megatron's RNG tracker; a device allocator's peak cannot be set back, so there the trials may
raise it), and `NPUSPEED_FUSED_OP_PATH=cpp|triton|npu|native|megatron|auto` forces a choice
(tests, bitwise-repeatable runs; `npuspeed` means the flag's own kernel here: C++ on CPU,
torch_npu's fused op on an NPU, Triton on CUDA). A kernel that runs unmeasured (forced, or under
`--deterministic-mode` below) is checked once per key against Megatron's forward output with the
warm-up's tolerance and raises `ForcedKernelDisagrees` (op, path, gap) where the rule would drop
it; a candidate the rule drops is said once per op and path (`notify`).
Ranks measure on their own, except where every rank of a group must run the same kernel: the
features hand the chooser an `agree` hook (RMSNorm: the TP group, see
npuspeed/features/chooser_setup.py); force a path where more must agree.
Under `--deterministic-mode` nothing is measured: npuspeed's kernel runs where it takes the
call, else Megatron's path, on every rank and in every run (a resume re-runs the same code).
"""
from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from npuspeed.ops import _dispatch
from npuspeed.ops.choose.chooser import Chooser as _Chooser
from npuspeed.ops.choose.criteria import Fastest
from npuspeed.ops.choose.record import MEGATRON, Choice
from npuspeed.ops.choose.trial import AGREE, ForcedKernelDisagrees, Guard

__all__ = ["AGREE", "CHOOSER", "Choice", "Chooser", "ForcedKernelDisagrees", "Guard", "MEGATRON", "choices",
           "compiled", "forced", "key_of", "label", "liger", "run_chosen", "triton_kernel"]

log = logging.getLogger("npuspeed")

FORCE_ENV = "NPUSPEED_FUSED_OP_PATH"
FORCEABLE = ("auto", "cpp", "triton", "npu", "native", "compile", "liger", "megatron", "npuspeed")
#: whether torch.compile of Megatron's function is a candidate: auto (on accelerators only: on a
#: CPU each shape's compile takes seconds to a minute of the run's first step), 1, 0
COMPILE_ENV = "NPUSPEED_FUSED_OP_COMPILE"
#: what "npuspeed" (forced, or --deterministic-mode) takes, first present wins: the C++ kernel on
#: CPU, torch_npu's fused op on an NPU (the flags' NPU path), the Triton kernel on CUDA (or on an
#: NPU whose torch_npu lacks the op), torch's grouped matmul (--moe-grouped-gemm's kernel)
NPUSPEED_KERNELS = ("cpp", "npu", "triton", "torch")


def Chooser(repeats: int = 3, trial=None, sync=None, guard=None, budget_s: float = 0.2) -> _Chooser:
    """The fused ops' chooser: fastest wins, NPUSPEED_FUSED_OP_PATH forces, "npuspeed" means the
    flag's own kernel (NPUSPEED_KERNELS), every unmeasured kernel is checked against Megatron's."""
    return _Chooser(repeats, trial, sync, guard, budget_s, criterion=Fastest(), force_env=FORCE_ENV,
                    forceable=FORCEABLE[1:-1], aliases={"npuspeed": NPUSPEED_KERNELS},
                    preference=NPUSPEED_KERNELS, name="fused ops")


def forced() -> str | None:
    """The implementation NPUSPEED_FUSED_OP_PATH forces, or None for auto."""
    return CHOOSER.forced()


def label(*tensors: torch.Tensor, extra: str = "", rows: bool = False) -> str:
    """"4096x512 bf16 cpu" from the first tensor's shape (`rows`: leading dims folded)."""
    first = tensors[0]
    dims = list(first.shape)
    if rows and len(dims) > 1:
        dims = [first.numel() // max(dims[-1], 1), dims[-1]]
    shape = "x".join(str(s) for s in dims) or "scalar"
    dtype = str(first.dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float", "fp")
    return f"{shape} {dtype} {first.device.type}{(' ' + extra) if extra else ''}"


def key_of(op: str, tensors, extra=()) -> tuple:
    """Cache key: op, device type, dtypes, shapes, strides' contiguity, grad needs, options.
    (A candidate may return a tuple, e.g. RoPE's (q, k): each part is checked and back-propagated.)
    Grad mode is not part of it: a recompute's first forward runs under no_grad on inputs that
    need grad, and must take the kernel its rerun in backward (and the run without recompute)
    takes, or the recomputed output would round differently from the one the forward used."""
    return (op, tuple((t.device.type, t.dtype, tuple(t.shape), t.is_contiguous(), t.requires_grad)
                      for t in tensors), tuple(extra))


#: the process's chooser, shared by every fused-op flag (the report reads its choices)
CHOOSER = Chooser()


def choices() -> list[Choice]:
    return list(CHOOSER.choices.values())


#: whether host tensors may take npuspeed's Triton kernels: only where a test runs them under
#: the interpreter (a test tool, not a fast path)
TRITON_ON_HOST = False


def triton_takes(*tensors: torch.Tensor) -> bool:
    """Whether these tensors may go to a Triton kernel: all on one accelerator (its kernel's
    `available()` and `supports()` decide the rest), or all on the host where TRITON_ON_HOST."""
    if not tensors or any(t.is_meta for t in tensors) or len({t.device.type for t in tensors}) != 1:
        return False
    return TRITON_ON_HOST if _dispatch.on_host(*tensors) else True


def triton_kernel(module: str, name: str, *tensors: torch.Tensor, check: str = "supports"):
    """npuspeed's Triton kernel `npuspeed.ops.triton.<module>.<name>` for these accelerator
    tensors, or None (host tensors, triton not importable, its `available()` says no, or its
    `supports(*tensors)`, or the function named by `check`, refuses the call, where it would run
    a reference). Imported lazily: triton is an optional dependency and takes seconds to import."""
    if not triton_takes(*tensors):
        return None
    try:
        import importlib

        module_ = importlib.import_module(f"npuspeed.ops.triton.{module}")
    except ImportError:
        return None
    if not getattr(module_, "available", lambda: False)():
        return None
    supports = getattr(module_, check, None)
    if supports is not None and not supports(*tensors):
        return None
    return getattr(module_, name, None)


def choose(op: str, candidates: dict[str, Callable], inputs: tuple, extra=(), text_extra: str = "",
           rows: bool = False, chooser: _Chooser | None = None) -> Choice:
    """The (cached) choice for this call: what `run_chosen` runs, and what the kernel table
    (npuspeed.ops.fused_table) shows; `chooser`: another chooser than the process's (a table's
    own, measuring the same way from a clean cache)."""
    chooser = CHOOSER if chooser is None else chooser
    key = key_of(op, inputs, extra) + (chooser.forced(),)  # a forced choice never hides a measured one
    choice = chooser.choices.get(key)
    if choice is None:
        choice = chooser.pick(op, key, label(*inputs, extra=text_extra, rows=rows), candidates, inputs)
    return choice


def run_chosen(op: str, candidates: dict[str, Callable], inputs: tuple, extra=(), text_extra: str = "",
               rows: bool = False):
    """Pick (cached) and run the chosen candidate on `inputs`, counting `ops.<op>.<impl>`."""
    choice = choose(op, candidates, inputs, extra, text_extra, rows)
    if choice.impl not in candidates:  # e.g. a cached choice of a kernel this call cannot take
        choice = Choice(op, choice.label, MEGATRON, "not a candidate for this call")
    _dispatch.record(op, choice.impl)
    with _dispatch.quiet():  # the front ends count themselves; the choice is counted above
        return candidates[choice.impl](*inputs)


def compile_wanted(*tensors: torch.Tensor) -> bool:
    """Whether torch.compile is a candidate for these tensors (NPUSPEED_FUSED_OP_COMPILE)."""
    value = os.environ.get(COMPILE_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "1", "0"):
        raise ValueError(f"{COMPILE_ENV}={value!r}: use auto (torch.compile is a fused-op candidate on "
                         f"accelerators only), 1 (everywhere, CPU included) or 0 (nowhere)")
    if value == "auto":
        return bool(tensors) and not _dispatch.on_host(*tensors)
    return value == "1"


#: the compiled function per eager function (one torch.compile object each: dynamo caches the
#: graphs per shape on it), and why torch.compile stopped being a candidate (first failure)
_COMPILED: dict = {}
_COMPILE_FAILED: list[str] = []


def _compile_failed(op: str, exc: BaseException) -> None:
    if not _COMPILE_FAILED:
        _COMPILE_FAILED.append(f"{op}: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}")
        log.warning("npuspeed: torch.compile failed on fused %s (%s); it is no fused-op candidate from now on "
                    "(set %s=0 to skip it)", op, _COMPILE_FAILED[0], COMPILE_ENV)


def compile_failure() -> str | None:
    """Why torch.compile is no longer a candidate in this process, or None."""
    return _COMPILE_FAILED[0] if _COMPILE_FAILED else None


def compiled(op: str, fn: Callable, *tensors: torch.Tensor) -> Callable | None:
    """torch.compile(fn) as a candidate for a call on `tensors`, or None (not wanted here, a
    traced or meta call, or torch.compile failed once in this process: said once in the log).
    `fn` must be the same function every call (a module-level one), so dynamo compiles once
    per shape. The compile happens in the chooser's warm-up (its first-call time, reported
    apart); a failure there raises so the chooser drops the candidate (said once); a failure
    outside a trial (a later recompile) runs `fn` eagerly, the same maths."""
    if _COMPILE_FAILED or not compile_wanted(*tensors) or any(t.is_meta for t in tensors) \
            or torch.compiler.is_compiling():
        return None
    compiled_fn = _COMPILED.get(fn)
    if compiled_fn is None:
        try:
            compiled_fn = _COMPILED[fn] = torch.compile(fn, dynamic=False)
        except Exception as exc:  # noqa: BLE001 - e.g. a Python torch.compile does not support
            _compile_failed(op, exc)
            return None

    def run(*args):
        from npuspeed.ops.choose import trial

        try:
            return compiled_fn(*args)
        except Exception as exc:  # noqa: BLE001 - inductor's toolchain, a dynamo limit, ...
            _compile_failed(op, exc)
            if trial.in_trial():
                raise
            return fn(*args)

    return run


#: Liger-Kernel's autograd functions this module offers, by npuspeed's name: (module, class)
LIGER = {"rms_norm": ("liger_kernel.ops.rms_norm", "LigerRMSNormFunction"),
         "swiglu": ("liger_kernel.ops.swiglu", "LigerSiLUMulFunction"),
         "rope": ("liger_kernel.ops.rope", "LigerRopeFunction")}
_LIGER: dict = {}


def _liger_import(name: str):
    """Liger's function class `name` (LIGER), or None where liger_kernel does not import. The
    package first (`liger_kernel.ops` swaps in a device's own implementation, e.g. an NPU's),
    then its submodule. Imported on first use only: it imports triton and probes the device."""
    if name not in _LIGER:
        import importlib

        module, cls = LIGER[name]
        found = None
        for where in ("liger_kernel.ops", module):
            try:
                found = getattr(importlib.import_module(where), cls, None)
            except Exception:  # noqa: BLE001 - not installed, or no device it supports
                found = None
            if found is not None:
                break
        _LIGER[name] = found
    return _LIGER[name]


def liger(name: str, *tensors: torch.Tensor):
    """Liger-Kernel's autograd function `name` (rms_norm, swiglu, rope) for these tensors, or
    None: Liger's kernels are Triton's, so only where npuspeed's Triton kernels may take the
    tensors (an accelerator triton targets) and `liger_kernel` imports (an optional extra)."""
    if not triton_takes(*tensors):
        return None
    try:
        from npuspeed.ops.triton import _runtime
    except ImportError:
        return None
    if not _runtime.runs_on(*tensors):
        return None
    return _liger_import(name)

