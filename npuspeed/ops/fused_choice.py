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
npuspeed/features/fused_ops/measure.py); force a path where more must agree.
Under `--deterministic-mode` nothing is measured: npuspeed's kernel runs where it takes the
call, else Megatron's path, on every rank and in every run (a resume re-runs the same code).
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from npuspeed.ops import _dispatch

FORCE_ENV = "NPUSPEED_FUSED_OP_PATH"
MEGATRON = "megatron"
FORCEABLE = ("auto", "cpp", "triton", "npu", "native", "megatron", "npuspeed")
#: what "npuspeed" (forced, or --deterministic-mode) takes, first present wins: the C++ kernel on
#: CPU, torch_npu's fused op on an NPU (the flags' NPU path), the Triton kernel on CUDA (or on an
#: NPU whose torch_npu lacks the op), torch's grouped matmul (--moe-grouped-gemm's kernel)
NPUSPEED_KERNELS = ("cpp", "npu", "triton", "torch")
#: forward agreement with Megatron's output needed to be a candidate (the kernels round once)
AGREE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@dataclass
class Choice:
    """One key's decision: what runs, why, and the measured fwd+bwd milliseconds."""

    op: str
    label: str  # e.g. "4096x512 bf16 cpu"
    impl: str
    why: str
    ms: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        """Megatron's time over the chosen one's (None when not measured)."""
        mine, base = self.ms.get(self.impl), self.ms.get(MEGATRON)
        return base / mine if mine and base else None

    def line(self) -> str:
        """The report line, e.g. "rms_norm [4096x512 bf16 cpu]: cpp (1.40x megatron; ...)"."""
        return f"{self.op} [{self.label}]: {self.impl} ({self.why})"

    def as_dict(self) -> dict:
        return {"op": self.op, "shape": self.label, "impl": self.impl, "why": self.why,
                "ms": {k: round(v, 4) for k, v in self.ms.items()}, "dropped": dict(self.dropped)}


def forced() -> str | None:
    """The implementation NPUSPEED_FUSED_OP_PATH forces, or None for auto."""
    value = os.environ.get(FORCE_ENV, "auto").strip().lower() or "auto"
    if value not in FORCEABLE:
        raise ValueError(f"{FORCE_ENV}={value!r}: use one of {', '.join(FORCEABLE)}")
    return None if value == "auto" else value


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


def clock_for(inputs) -> Callable[[], float]:
    """The clock a trial reads: the calling thread's CPU time for CPU tensors with one intra-op
    thread (all the work is on this thread, and a busy host's preemption is not counted, so
    the order of the candidates is stable), wall time otherwise (several threads: their
    parallel efficiency is part of the speed; accelerators: after a synchronize)."""
    on_cpu = all(t.device.type == "cpu" for t in inputs)
    return time.thread_time if on_cpu and torch.get_num_threads() == 1 else time.perf_counter


def _time_once(run, sync: Callable[[], None], clock=time.perf_counter) -> float:
    if hasattr(run, "prepare"):  # copying the inputs is not part of the time
        run.prepare()
    sync()
    start = clock()
    run()
    sync()
    return clock() - start


class Chooser:
    """Per key: which candidate runs (see the module docstring). `trial(name, run) -> seconds`
    can be injected (tests give fake timings); `sync` waits for the device (timing)."""

    def __init__(self, repeats: int = 3, trial: Callable[[str, Callable], float] | None = None,
                 sync: Callable[[], None] | None = None, guard: Callable | None = None,
                 budget_s: float = 0.2):
        self.repeats, self.budget_s = repeats, budget_s
        self.sync = sync or (lambda: None)
        self._injected = trial
        self.clock = time.perf_counter
        self._timed = lambda name, run: _time_once(run, self.sync, self.clock)
        self.trial = trial or self._timed
        self.guard = guard or Guard()
        self.choices: dict[tuple, Choice] = {}
        self.notify: Callable[[str], None] | None = None
        #: agree(op, names, seconds) -> seconds: the timings every rank that must run the same
        #: kernel for `op` decides on (the fused-op features: the MAX over the TP group)
        self.agree: Callable[[str, list, list], list] | None = None
        self._noted: set[str] = set()

    def configure(self, *, sync=None, guard=None, notify=None, agree=None) -> None:
        """The accelerator's synchronize and state guard, where the one note per op goes when a
        flag takes Megatron's path (set by the fused-op features: ctx.note), and how ranks
        agree on the timings (`agree`, see __init__)."""
        if agree is not None:
            self.agree = agree
        if sync is not None:
            self.sync = sync
        if guard is not None:
            self.guard = guard
        if notify is not None:
            self.notify = notify

    def clear(self) -> None:
        self.choices.clear()
        self._noted.clear()

    def pick(self, op: str, key: tuple, text: str, candidates: dict[str, Callable],
             inputs: tuple) -> Choice:
        """The cached choice for `key`, measuring the candidates on `inputs` the first time.
        `candidates` maps name -> fn(*inputs) -> tensor; it must contain `megatron`."""
        hit = self.choices.get(key)
        if hit is not None:
            return hit
        want = forced()
        if want is not None:
            choice = self._checked(self._forced(op, text, candidates, want), candidates, inputs)
        elif torch.are_deterministic_algorithms_enabled():
            choice = self._checked(self._forced(op, text, candidates, "npuspeed", "--deterministic-mode: not "
                                                "measured, so every rank and every run takes the same kernel"),
                                   candidates, inputs)
        elif len(candidates) == 1:
            (only,) = candidates
            choice = Choice(op, text, only, "the only implementation here")
        elif _traced(inputs):
            choice = Choice(op, text, MEGATRON, "not measured: traced or fake tensors")
        else:
            choice = self._measure(op, text, candidates, inputs)
        self.choices[key] = choice
        for name, reason in choice.dropped.items():
            self._note(f"{op}:{name}", f"fused {op}: {name} dropped for {choice.label}: {reason}; another "
                       f"path runs there (`npuspeed report` lists every shape)")
        if choice.impl == MEGATRON and choice.ms:
            timings = choice.why.split(": ", 1)[-1]
            self._note(op, f"fused {op}: Megatron's own path runs for {choice.label}, measured faster than "
                       f"the fused kernels there ({timings}); `npuspeed report` lists every shape")
        return choice

    def _note(self, what: str, message: str) -> None:
        if self.notify is not None and what not in self._noted:
            self._noted.add(what)
            self.notify(message)

    def _checked(self, choice: Choice, candidates, inputs) -> Choice:
        """A forced kernel, checked once per key against Megatron's forward output with the
        rule's tolerance: one that the rule would drop for disagreeing raises here instead of
        running (unmeasured, it would train on wrong numbers and still be counted as run)."""
        if choice.impl == MEGATRON or MEGATRON not in candidates or _traced(inputs):
            return choice
        with self.guard(), _dispatch.quiet(), torch.no_grad():
            try:
                reference = _Run(candidates[MEGATRON], inputs, False)()
            except Exception as exc:  # noqa: BLE001 - nothing to compare with; the forced kernel still runs
                choice.why += f"; not checked: Megatron's path raised {type(exc).__name__}"
                return choice
            out = _Run(candidates[choice.impl], inputs, False)()
        if not _agrees(out, reference):
            raise ForcedKernelDisagrees(
                f"fused {choice.op} [{choice.label}]: {choice.impl} ({choice.why}) disagrees with Megatron's "
                f"path: {_gap(out, reference)}; fix the kernel, or unset {FORCE_ENV} (the rule then drops it)")
        return choice

    @staticmethod
    def _forced(op, text, candidates, want, by: str | None = None) -> Choice:
        by = by or f"forced by {FORCE_ENV}={want}"
        names = [want] if want != "npuspeed" else [n for n in NPUSPEED_KERNELS if n in candidates]
        for name in names:
            if name in candidates:
                return Choice(op, text, name, by)
        return Choice(op, text, MEGATRON, f"{by}; {want} is not available for this call")

    def _measure(self, op, text, candidates, inputs) -> Choice:
        grads = any(t.requires_grad for t in inputs)  # under no_grad too: see key_of
        self.clock = clock_for(inputs)
        runs, dropped, reference = {}, {}, None
        with self.guard(), _dispatch.quiet(), torch.enable_grad() if grads else contextlib.nullcontext():
            order = [MEGATRON] + [n for n in candidates if n != MEGATRON]
            first = {}  # the warm-up's own time per candidate (see below)
            for name in order:  # warm-up round: compiles, registers, checks agreement
                run = _make_run(candidates[name], inputs, grads)
                try:
                    run.prepare()
                    self.sync()
                    start = self.clock()
                    out = run()
                    self.sync()
                    first[name] = self.clock() - start
                except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is dropped
                    if name == MEGATRON:
                        raise
                    dropped[name] = f"raised {type(exc).__name__}: {str(exc)[:80]}"
                    continue
                if name == MEGATRON:
                    reference = out
                elif not _agrees(out, reference):
                    dropped[name] = f"output differs from Megatron's ({_gap(out, reference)})"
                    continue
                runs[name] = run
            best = {name: float("inf") for name in runs}
            spent, rounds = 0.0, 0
            if self.trial is self._timed and sum(first[n] for n in runs) > self.budget_s:
                # an expensive op (seconds per fwd+bwd on a slow backend, e.g. bf16 GEMMs on a
                # CPU without bf16 units): the warm-up is the sample; repeating it would cost
                # more than any difference it can find, and the step that meets the shape pays
                best = {name: first[name] for name in runs}
                spent, rounds = sum(best.values()), self.repeats  # no timed rounds
            # at least `repeats` rounds; more (up to 4x) while cheap, as a busy host's stalls
            # dwarf a sub-millisecond op and the minimum needs a few clean samples
            while rounds < self.repeats or (rounds < 4 * self.repeats and spent < self.budget_s):
                for name, run in runs.items():
                    seconds = self.trial(name, run)
                    best[name] = min(best[name], seconds)
                    spent += seconds
                rounds += 1
        if self.agree is not None:  # every candidate in one order on every rank; inf = dropped here
            names = sorted(candidates)
            agreed = self.agree(op, names, [best.get(n, float("inf")) for n in names])
            for name, seconds in zip(names, agreed):
                if name in best and seconds == float("inf"):
                    dropped[name] = "dropped on another rank"
            best = {n: s for n, s in zip(names, agreed) if n in best and s != float("inf")}
            if MEGATRON not in best:
                raise RuntimeError(f"fused {op}: Megatron's path did not run on every rank")
        ms = {name: s * 1e3 for name, s in best.items()}
        impl = min(ms, key=lambda n: (ms[n], n != MEGATRON))
        base = ms[MEGATRON]
        others = ", ".join(f"{n} {v:.3f}" for n, v in sorted(ms.items(), key=lambda kv: kv[1]))
        pass_ = "fwd+bwd" if grads else "fwd"
        if self._injected is None and self.clock is time.thread_time:
            pass_ += " CPU time"
        if impl == MEGATRON:
            why = f"Megatron's path is fastest here: {others} ms {pass_}"
        else:
            why = f"{base / ms[impl]:.2f}x megatron: {others} ms {pass_}"
        if dropped:
            why += "; dropped " + ", ".join(f"{n} ({r})" for n, r in dropped.items())
        return Choice(op, text, impl, why, ms, dropped)


def _traced(inputs) -> bool:
    """Fake, meta or compiled-graph inputs: nothing real to time."""
    from torch._subclasses.fake_tensor import FakeTensor

    return torch.compiler.is_compiling() or any(t.is_meta or isinstance(t, FakeTensor) for t in inputs)


class _Run:
    """One candidate's trial: `prepare()` makes fresh leaves (untimed), calling it runs forward
    (+ backward) on them and returns the forward output (it prepares itself if needed)."""

    def __init__(self, fn, inputs, grads):
        self.fn, self.inputs, self.grads, self.leaves = fn, inputs, grads, None

    def prepare(self) -> None:
        self.leaves = [t.detach().clone().requires_grad_(t.requires_grad) if t.is_floating_point() else t
                       for t in self.inputs]

    def __call__(self):
        if self.leaves is None:
            self.prepare()
        leaves, self.leaves = self.leaves, None
        out = self.fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)  # e.g. RoPE's (q, k)
        if self.grads:
            wrt = [t for t in leaves if t.requires_grad]
            torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs])
        return tuple(o.detach() for o in outs) if isinstance(out, tuple) else out.detach()


def _make_run(fn, inputs, grads) -> _Run:
    return _Run(fn, inputs, grads)


def _gap(out, ref) -> str:
    """How `out` misses `ref`: the largest |difference| against the tolerance, or the mismatch."""
    if isinstance(ref, tuple):
        if not isinstance(out, tuple) or len(out) != len(ref):
            return f"{type(out).__name__} where Megatron returns a {len(ref)}-tuple"
        return "; ".join(f"part {i}: {_gap(o, r)}" for i, (o, r) in enumerate(zip(out, ref)) if not _agrees(o, r))
    if isinstance(out, tuple) or out.shape != ref.shape or out.dtype != ref.dtype:
        got = "a tuple" if isinstance(out, tuple) else f"{tuple(out.shape)} {out.dtype}"
        return f"{got} where Megatron gives {tuple(ref.shape)} {ref.dtype}"
    tol = AGREE.get(out.dtype, 1e-3)
    diff = (out.float() - ref.float()).abs().nan_to_num(float("inf")).max().item() if out.numel() else 0.0
    return f"max |diff| {diff:.3g} (tolerance {tol:g} abs + {tol:g} rel)"


class ForcedKernelDisagrees(RuntimeError):
    """A forced kernel's output is not Megatron's (see Chooser._checked)."""


def _agrees(out, ref) -> bool:
    if isinstance(ref, tuple):
        return isinstance(out, tuple) and len(out) == len(ref) and all(map(_agrees, out, ref))
    if isinstance(out, tuple) or out.shape != ref.shape or out.dtype != ref.dtype:
        return False
    tol = AGREE.get(out.dtype, 1e-3)
    return bool(torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol))


#: the process's chooser, shared by every fused-op flag (the report reads its choices)
CHOOSER = Chooser()


def choices() -> list[Choice]:
    return list(CHOOSER.choices.values())


#: device types whose tensors may take npuspeed's Triton kernels (not CPU: the interpreter is
#: a test tool, not a fast path)
TRITON_DEVICES = {"cuda", "npu"}


def triton_kernel(module: str, name: str, *tensors: torch.Tensor, check: str = "supports"):
    """npuspeed's Triton kernel `npuspeed.ops.triton.<module>.<name>` for these accelerator
    tensors, or None (CPU tensors, triton not importable, its `available()` says no, or its
    `supports(*tensors)`, or the function named by `check`, refuses the call, where it would run
    a reference). Imported lazily: triton is an optional dependency and takes seconds to import."""
    if not tensors or {t.device.type for t in tensors} - TRITON_DEVICES:
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
