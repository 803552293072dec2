"""Which implementation a fused-op flag runs: the fastest correct one, measured once per shape.

`--use-fused-rmsnorm`, `--use-fused-swiglu`, `--use-fused-rotary-pos-emb` (and the MoE ops)
each hand `Chooser.pick` their candidates for one call: the device's native op (`npu`:
torch_npu's fused kernel; `native`: torch's own where it differs from Megatron's), npuspeed's
kernel (`cpp` on CPU, `triton` on CUDA/NPU when importable) and `megatron`, the path that runs
with the flag off. Per key (op, device type, dtype, shapes, options) every candidate runs
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

from typing import Callable

import torch

from npuspeed.ops import _dispatch
from npuspeed.ops.choose.chooser import Chooser as _Chooser
from npuspeed.ops.choose.criteria import Fastest
from npuspeed.ops.choose.record import MEGATRON, Choice
from npuspeed.ops.choose.trial import AGREE, ForcedKernelDisagrees, Guard

__all__ = ["AGREE", "CHOOSER", "Choice", "Chooser", "ForcedKernelDisagrees", "Guard", "MEGATRON", "choices",
           "forced", "key_of", "label", "run_chosen", "triton_kernel"]

FORCE_ENV = "NPUSPEED_FUSED_OP_PATH"
FORCEABLE = ("auto", "cpp", "triton", "npu", "native", "megatron", "npuspeed")
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


def run_chosen(op: str, candidates: dict[str, Callable], inputs: tuple, extra=(), text_extra: str = "",
               rows: bool = False):
    """Pick (cached) and run the chosen candidate on `inputs`, counting `ops.<op>.<impl>`."""
    key = key_of(op, inputs, extra) + (forced(),)  # a forced choice never hides a measured one
    choice = CHOOSER.choices.get(key)
    if choice is None:
        choice = CHOOSER.pick(op, key, label(*inputs, extra=text_extra, rows=rows), candidates, inputs)
    if choice.impl not in candidates:  # e.g. a cached choice of a kernel this call cannot take
        choice = Choice(op, choice.label, MEGATRON, "not a candidate for this call")
    _dispatch.record(op, choice.impl)
    with _dispatch.quiet():  # the front ends count themselves; the choice is counted above
        return candidates[choice.impl](*inputs)
