"""The fused-op rule (npuspeed/ops/fused_choice.py): the chooser picks the fastest candidate
from injected timings (deterministic), caches per op/shape/dtype/device, honours forced paths,
counts only the call that ran (trials are silent), drops candidates that raise or disagree,
puts the random state back, and the report says what ran and why."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from npuspeed import telemetry
from npuspeed.ops import _dispatch, fused_choice
from npuspeed.ops._extension import has_op
from npuspeed.ops.fused_choice import Chooser

needs_cpp = pytest.mark.skipif(not has_op("rms_norm"), reason="C++ op library not built")


class FakeTimes:
    """trial(name, run): runs the candidate (so it must work) and returns a fixed time."""

    def __init__(self, **seconds):
        self.seconds, self.calls = seconds, []

    def __call__(self, name, run):
        run()
        self.calls.append(name)
        return self.seconds[name]


@pytest.fixture
def chooser(monkeypatch):
    """A fresh process chooser with fake timings set per test through `chooser.trial`."""
    fresh = Chooser(repeats=2, budget_s=0.0)
    monkeypatch.setattr(fused_choice, "CHOOSER", fresh)
    monkeypatch.delenv(fused_choice.FORCE_ENV, raising=False)
    _dispatch.reset_calls()
    return fresh


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_(True)


def _megatron_norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-5)


def _norm_call(x, w):
    from npuspeed.ops.rms_norm import fused_rms_norm

    return fused_rms_norm(x, w, 1e-5, _megatron_norm)


def _cands(**extra):
    base = {"megatron": lambda x: x * 2}
    base.update(extra)
    return base


@pytest.mark.parametrize("times, expected", [
    (dict(megatron=2.0, cpp=1.0, triton=1.5), "cpp"),
    (dict(megatron=1.0, cpp=2.0, triton=1.5), "megatron"),
    (dict(megatron=2.0, cpp=1.5, triton=1.0), "triton"),
    (dict(megatron=1.0, cpp=1.0, triton=1.0), "megatron"),  # ties go to the flag-off path
])
def test_picks_the_fastest_from_injected_timings(chooser, times, expected):
    chooser.trial = FakeTimes(**times)
    x = _x(4, 8)
    cands = _cands(cpp=lambda x: x * 2, triton=lambda x: x + x)
    choice = chooser.pick("op", ("k",), "4x8", cands, (x,))
    assert choice.impl == expected
    assert choice.ms == {k: v * 1e3 for k, v in times.items()}
    assert choice.speedup == pytest.approx(times["megatron"] / times[expected])
    assert sorted(chooser.trial.calls) == sorted(list(times) * 2)  # `repeats` interleaved rounds
    if expected != "megatron":
        assert f"{choice.speedup:.2f}x megatron" in choice.why and "fwd+bwd" in choice.why


def test_candidates_that_raise_or_disagree_are_dropped(chooser):
    chooser.trial = FakeTimes(megatron=3.0, good=2.0)

    def boom(x):
        raise RuntimeError("no kernel for this")

    choice = chooser.pick("op", ("k",), "t", _cands(good=lambda x: x * 2, wrong=lambda x: x * 3, boom=boom),
                          (_x(4, 8),))
    assert choice.impl == "good"
    assert set(choice.dropped) == {"wrong", "boom"} and "differs" in choice.dropped["wrong"]
    assert "RuntimeError" in choice.dropped["boom"] and "dropped" in choice.why


@needs_cpp
def test_cache_is_per_shape_dtype_and_device(chooser):
    chooser.trial = FakeTimes(megatron=2.0, cpp=1.0)
    w = torch.ones(16, requires_grad=True)
    for _ in range(3):
        _norm_call(_x(8, 16), w)
    assert len(chooser.choices) == 1 and chooser.trial.calls.count("cpp") == 2  # measured once
    _norm_call(_x(4, 16), w)  # new shape
    _norm_call(_x(8, 16, dtype=torch.bfloat16), w.detach().bfloat16().requires_grad_())  # new dtype
    assert len(chooser.choices) == 3
    labels = sorted(c.label for c in fused_choice.choices())
    assert labels == ["4x16 fp32 cpu", "8x16 bf16 cpu", "8x16 fp32 cpu"]
    cpu, meta = torch.empty(2, 3), torch.empty(2, 3, device="meta")
    assert fused_choice.key_of("rms_norm", (cpu,)) != fused_choice.key_of("rms_norm", (meta,))


@needs_cpp
def test_a_recomputes_no_grad_forward_takes_the_kernel_its_backward_rerun_takes(chooser):
    """Recompute runs the first forward under no_grad on inputs that need grad: it must share
    the grad-mode choice (one key, one measurement), or the rerun would round differently."""
    chooser.trial = FakeTimes(megatron=2.0, cpp=1.0)
    w = torch.ones(16, requires_grad=True)
    with torch.no_grad():
        _norm_call(_x(8, 16), w)
    _norm_call(_x(8, 16), w).sum().backward()
    assert len(chooser.choices) == 1
    assert _dispatch.calls() == {("rms_norm", "cpp"): 2}


@needs_cpp
@pytest.mark.parametrize("winner", ["cpp", "megatron"])
def test_the_counter_shows_the_chosen_path_ran_and_trials_count_nothing(chooser, winner):
    chooser.trial = FakeTimes(megatron=1.0 if winner == "megatron" else 2.0, cpp=1.0 if winner == "cpp" else 2.0)
    before = telemetry.snapshot()
    w = torch.ones(16, requires_grad=True)
    out = _norm_call(_x(8, 16), w)
    out.sum().backward()
    _norm_call(_x(8, 16), w)
    assert _dispatch.calls() == {("rms_norm", winner): 2}
    assert {k for k in telemetry.since(before) if not k.startswith("ops.")} == set()


@needs_cpp
def test_chosen_cpp_is_really_the_kernel(chooser, monkeypatch):
    """With cpp chosen, Megatron's function is never called by the real call."""
    chooser.trial = FakeTimes(megatron=2.0, cpp=1.0)
    w = torch.ones(16, requires_grad=True)
    _norm_call(_x(8, 16), w)  # measure
    seen = []
    from npuspeed.ops import rms_norm as rms_mod

    cands = rms_mod.candidates(_x(8, 16), w, 1e-5, lambda x, w: seen.append(1) or _megatron_norm(x, w))
    fused_choice.run_chosen("rms_norm", cands, (_x(8, 16), w), extra=(1e-5,))
    assert seen == [] and _dispatch.calls()[("rms_norm", "cpp")] == 2


@pytest.mark.parametrize("force, expected, why", [
    ("megatron", "megatron", "forced by"),
    ("cpp", "cpp", "forced by"),
    ("npuspeed", "cpp", "forced by"),
    ("triton", "megatron", "not available"),
])
def test_forced_paths(chooser, monkeypatch, force, expected, why):
    if expected == "cpp" and not has_op("rms_norm"):
        pytest.skip("C++ op library not built")
    chooser.trial = FakeTimes()  # any trial would raise KeyError: forced paths measure nothing
    monkeypatch.setenv(fused_choice.FORCE_ENV, force)
    w = torch.ones(16, requires_grad=True)
    _norm_call(_x(8, 16), w)
    (choice,) = fused_choice.choices()
    assert choice.impl == expected and why in choice.why and chooser.trial.calls == []
    assert _dispatch.calls() == {("rms_norm", expected): 1}
    monkeypatch.setenv(fused_choice.FORCE_ENV, "auto")  # the forced entry does not hide auto
    chooser.trial = FakeTimes(megatron=1.0, cpp=2.0)
    _norm_call(_x(8, 16), w)
    assert len(chooser.choices) == 2


def test_bad_forced_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(fused_choice.FORCE_ENV, "fastest")
    with pytest.raises(ValueError, match="NPUSPEED_FUSED_OP_PATH='fastest': use one of auto, cpp"):
        fused_choice.forced()


@needs_cpp
def test_real_measurement_puts_the_random_state_back_and_notes_once(chooser):
    notes = []
    chooser.configure(notify=notes.append)
    chooser.trial = FakeTimes(megatron=1.0, cpp=2.0)
    state = torch.get_rng_state()
    w = torch.ones(16, requires_grad=True)
    _norm_call(_x(8, 16), w)
    _norm_call(_x(4, 16), w)
    assert torch.equal(torch.get_rng_state(), state)
    assert len(notes) == 1 and "Megatron's own path runs for 8x16 fp32 cpu" in notes[0]
    real = Chooser(repeats=1)  # real clock: still a valid choice with a why
    x = _x(8, 16)
    choice = real.pick("rms_norm", ("real",), "8x16", {"megatron": _megatron_norm,
                                                       "cpp": lambda x, w: _megatron_norm(x, w)}, (x, w))
    assert choice.impl in ("megatron", "cpp") and set(choice.ms) == {"megatron", "cpp"}
    assert x.grad is None and w.grad is None  # trials ran on copies


def test_report_line_and_report_json(chooser):
    chooser.trial = FakeTimes(megatron=1.4e-3, cpp=1.0e-3)
    x = _x(4096, 512, dtype=torch.bfloat16)
    choice = chooser.pick("rms_norm", ("k",), fused_choice.label(x, rows=True),
                          {"megatron": lambda x: x * 2, "cpp": lambda x: x + x}, (x,))
    assert choice.line().startswith("rms_norm [4096x512 bf16 cpu]: cpp (1.40x megatron: cpp 1.000, megatron 1.400 ms")
    from npuspeed import reporting

    rows = reporting._fused_op_choices()
    assert rows == [dict(choice.as_dict(), line=choice.line())]
    assert rows[0]["impl"] == "cpp" and rows[0]["shape"] == "4096x512 bf16 cpu"
    text = reporting.render({"npuspeed_version": "v", "torch_version": "t", "megatron_core_version": "m",
                             "python_version": "p", "device": "cpu",
                             "accelerator": {"device_name": "cpu", "memory_tracking": "x"},
                             "dist_backend": "gloo", "features": [], "ops": [], "patches": [], "notes": [],
                             "fused_op_choices": rows})
    assert "fused op choices" in text and choice.line() in text


@needs_cpp
@pytest.mark.parametrize("winner", ["cpp", "megatron"])
def test_fused_rmsnorm_module_runs_the_choice(chooser, winner):
    """The module --use-fused-rmsnorm builds: Megatron's choice is torch.nn.RMSNorm bit for bit."""
    from npuspeed.features.fused_rmsnorm.rmsnorm import FusedRMSNorm

    chooser.trial = FakeTimes(megatron=1.0 if winner == "megatron" else 2.0, cpp=1.0 if winner == "cpp" else 2.0)
    plain = torch.nn.RMSNorm(16, eps=1e-6)
    fused = torch.nn.RMSNorm(16, eps=1e-6)
    fused.__class__ = FusedRMSNorm
    x = _x(8, 16)
    got, ref = fused(x), plain(x)
    if winner == "megatron":
        assert torch.equal(got, ref)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert _dispatch.calls() == {("rms_norm", winner): 1}


def test_triton_kernel_is_a_candidate_where_it_runs(chooser, monkeypatch):
    """npuspeed.ops.triton.<op> (helper `triton`'s kernels) joins the candidates through a lazy
    import: a stand-in module is chosen by its timing and counted; `supports` can refuse a call.
    (CPU tensors are let in here only for the test; real runs offer Triton on CUDA/NPU.)"""
    import sys
    import types

    fake = types.ModuleType("npuspeed.ops.triton.rms_norm")
    fake.available = lambda: True
    fake.supports = lambda x, w: x.shape[-1] % 16 == 0
    fake.rms_norm = lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps) * 1.0
    package = types.ModuleType("npuspeed.ops.triton")
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "npuspeed.ops.triton", package)
    monkeypatch.setitem(sys.modules, "npuspeed.ops.triton.rms_norm", fake)
    monkeypatch.setattr(fused_choice, "TRITON_ON_HOST", True)
    chooser.trial = FakeTimes(megatron=3.0, cpp=2.0, triton=1.0)
    w = torch.ones(16, requires_grad=True)
    _norm_call(_x(8, 16), w)
    assert _dispatch.calls() == {("rms_norm", "triton"): 1}
    from npuspeed.ops import rms_norm as rms_mod

    assert "triton" not in rms_mod.candidates(_x(8, 12), torch.ones(12), 1e-5, _megatron_norm)
    monkeypatch.delitem(sys.modules, "npuspeed.ops.triton.rms_norm")
    monkeypatch.setitem(sys.modules, "npuspeed.ops.triton", None)  # not importable: no candidate
    assert "triton" not in rms_mod.candidates(_x(8, 16), w, 1e-5, _megatron_norm)


def test_deterministic_mode_measures_nothing_and_takes_the_kernel(chooser):
    """Under --deterministic-mode every rank and run must run the same code: no timing decides."""
    if not has_op("rms_norm"):
        pytest.skip("C++ op library not built")
    chooser.trial = FakeTimes()  # any trial would raise KeyError
    torch.use_deterministic_algorithms(True)
    try:
        _norm_call(_x(8, 16), torch.ones(16, requires_grad=True))
    finally:
        torch.use_deterministic_algorithms(False)
    (choice,) = fused_choice.choices()
    assert choice.impl == "cpp" and "--deterministic-mode: not measured" in choice.why
    assert chooser.trial.calls == [] and _dispatch.calls() == {("rms_norm", "cpp"): 1}


@pytest.mark.parametrize("how", ["forced", "deterministic"])
def test_npuspeed_kernel_on_an_npu_is_torch_npus_fused_op(chooser, monkeypatch, how):
    """On an NPU the flag's kernel is torch_npu's fused op (`npu`): NPUSPEED_FUSED_OP_PATH=npuspeed
    and --deterministic-mode take it (the device tier expects it), not Megatron's path, and
    triton-ascend's kernel only where torch_npu has no op."""
    chooser.trial = FakeTimes()  # any trial would raise KeyError: nothing is measured
    x = _x(8, 16)
    cands = {"megatron": lambda t: t * 2, "npu": lambda t: t * 2, "triton": lambda t: t * 2}
    if how == "forced":
        monkeypatch.setenv(fused_choice.FORCE_ENV, "npuspeed")
    else:
        torch.use_deterministic_algorithms(True)
    try:
        picked = chooser.pick("rms_norm", ("k", how), "8x16", cands, (x,)).impl
        without_npu = chooser.pick("rms_norm", ("k2", how), "8x16",
                                   {k: v for k, v in cands.items() if k != "npu"}, (x,)).impl
    finally:
        torch.use_deterministic_algorithms(False)
    assert (picked, without_npu) == ("npu", "triton") and chooser.trial.calls == []


def test_agreement_hook_makes_ranks_take_one_implementation(chooser):
    """Ranks that must run the same kernel (RMSNorm without SP: its weight is replicated on every
    TP rank and its gradient is not reduced over TP) decide on timings agreed across them (the
    feature's hook takes the MAX over the TP group): here this rank measured cpp faster, the
    other rank Megatron's path, and cpp raised there; all take what the agreed timings say."""
    chooser.trial = FakeTimes(megatron=2.0, cpp=1.0, triton=3.0)
    other_rank = {"cpp": float("inf"), "megatron": 1.5, "triton": 0.5}  # cpp dropped over there
    seen = []

    def agree(op, names, seconds):
        seen.append((op, list(names)))
        return [max(s, other_rank[n]) for n, s in zip(names, seconds)]

    chooser.configure(agree=agree)
    cands = {"megatron": lambda t: t * 2, "cpp": lambda t: t * 2, "triton": lambda t: t * 2}
    choice = chooser.pick("rms_norm", ("k",), "8x16", cands, (_x(8, 16),))
    assert seen == [("rms_norm", ["cpp", "megatron", "triton"])]
    assert choice.impl == "megatron" and "cpp" in choice.dropped and "cpp" not in choice.ms
