"""One candidate's trial: fresh leaves, forward (+ backward), the clock that times it, the guard
that puts back what it disturbed, and the agreement check against the baseline's output."""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from npuspeed.ops.nesting import Nesting

#: forward agreement with Megatron's output needed to be a candidate (the kernels round once)
AGREE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 5e-2, torch.float16: 1e-2}


class ForcedKernelDisagrees(RuntimeError):
    """A forced kernel's output is not Megatron's (see Chooser._checked)."""


class Guard:
    """Puts back what a trial may disturb: the host RNG state and the tracked memory peaks.
    Features replace it with one that also covers the device and Megatron's RNG tracker."""

    @contextlib.contextmanager
    def __call__(self):
        from npuspeed.ops import memory_tracker

        host = torch.get_rng_state()
        peaks = (memory_tracker.peak(), memory_tracker.peak_reserved()) if memory_tracker.enabled() else None
        try:
            yield
        finally:
            torch.set_rng_state(host)
            if peaks is not None:
                memory_tracker.restore_peak(*peaks)

    def meter(self):
        """A `(start, peak_since)` pair that measures a trial's peak bytes where the peak can be
        put back afterwards (npuspeed's CPU tracker), else None (bytes come from the feature)."""
        from npuspeed.ops import memory_tracker

        if not memory_tracker.enabled():
            return None
        def start() -> int:
            memory_tracker.reset_peak()
            return memory_tracker.allocated()

        return start, lambda base: memory_tracker.peak() - base


def device_sync() -> None:
    """torch's own synchronize of the current accelerator (none on a CPU-only host): the clock's
    default, so a chooser no feature configured (a benchmark's, a bare op call's) still times
    the device's work on accelerator tensors, not the host's kernel launches (the H100 report
    of 2026-11-27 timed launches: see docs/fused_op_rule.md)."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        acc.synchronize()


#: inside while a chooser's trial runs (measure._scope): a candidate that fails there must raise
#: (the chooser drops it), where outside a trial it may fall back to the same maths run eagerly
_TRIAL = Nesting()


def in_trial() -> bool:
    return _TRIAL.inside


def trial_scope():
    return _TRIAL()


class Clock:
    """The clock policy, one for every chooser: the process's CPU time when every input is on the
    host (a busy host's preemption is not counted, so the order of the candidates does not
    depend on the load), device events on an accelerator (`events`: the accelerator's Event
    class, set by the features), else wall time between synchronizes."""

    def __init__(self, sync: Callable[[], None] | None = None, events: Callable | None = None):
        self.sync = sync or device_sync
        self.events = events

    def cpu(self, inputs) -> bool:
        return all(t.is_cpu for t in inputs if isinstance(t, torch.Tensor))

    def time(self, run, inputs) -> float:
        """Seconds of one `run()` (its `prepare()`, if any, is not timed)."""
        if hasattr(run, "prepare"):
            run.prepare()
        if self.cpu(inputs):
            start = time.process_time()
            run()
            return time.process_time() - start
        self.sync()
        if self.events is not None:
            begin, end = self.events(enable_timing=True), self.events(enable_timing=True)
            begin.record()
            run()
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) / 1e3
        start = time.perf_counter()
        run()
        self.sync()
        return time.perf_counter() - start


class Run:
    """One candidate's trial: `prepare()` makes fresh leaves (untimed), calling it runs forward
    (+ backward) on them and returns the forward output (it prepares itself if needed)."""

    def __init__(self, fn, inputs, grads):
        self.fn, self.inputs, self.grads, self.leaves = fn, inputs, grads, None

    def prepare(self) -> None:
        self.leaves = [t.detach().clone().requires_grad_(t.requires_grad)
                       if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in self.inputs]

    def __call__(self):
        if self.leaves is None:
            self.prepare()
        leaves, self.leaves = self.leaves, None
        out = self.fn(*leaves)
        if out is None:  # an in-place candidate (e.g. a weight-gradient accumulation)
            return None
        outs = out if isinstance(out, tuple) else (out,)  # e.g. RoPE's (q, k)
        if self.grads:
            wrt = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs])
        return tuple(o.detach() for o in outs) if isinstance(out, tuple) else out.detach()


def traced(inputs) -> bool:
    """Fake, meta or compiled-graph inputs: nothing real to time."""
    from torch._subclasses.fake_tensor import FakeTensor

    return torch.compiler.is_compiling() or any(
        isinstance(t, torch.Tensor) and (t.is_meta or isinstance(t, FakeTensor)) for t in inputs)


def gap(out, ref) -> str:
    """How `out` misses `ref`: the largest |difference| against the tolerance, or the mismatch."""
    if isinstance(ref, tuple):
        if not isinstance(out, tuple) or len(out) != len(ref):
            return f"{type(out).__name__} where Megatron returns a {len(ref)}-tuple"
        return "; ".join(f"part {i}: {gap(o, r)}" for i, (o, r) in enumerate(zip(out, ref)) if not agrees(o, r))
    if isinstance(out, tuple) or out.shape != ref.shape or out.dtype != ref.dtype:
        got = "a tuple" if isinstance(out, tuple) else f"{tuple(out.shape)} {out.dtype}"
        return f"{got} where Megatron gives {tuple(ref.shape)} {ref.dtype}"
    tol = AGREE.get(out.dtype, 1e-3)
    diff = (out.float() - ref.float()).abs().nan_to_num(float("inf")).max().item() if out.numel() else 0.0
    return f"max |diff| {diff:.3g} (tolerance {tol:g} abs + {tol:g} rel)"


def agrees(out, ref) -> bool:
    if isinstance(ref, tuple):
        return isinstance(out, tuple) and len(out) == len(ref) and all(map(agrees, out, ref))
    if isinstance(out, tuple) or out.shape != ref.shape or out.dtype != ref.dtype:
        return False
    tol = AGREE.get(out.dtype, 1e-3)
    return bool(torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol))
