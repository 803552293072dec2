"""Issue 48: the fused-op chooser's candidates include torch.compile and Liger-Kernel, a failing
candidate is dropped with one log line, a first call's compile never decides the pick, and the
kernel table (npuspeed.ops.fused_table, the device report's) is the chooser's own measurement
at the flags' own keys, so the two cannot disagree."""
from __future__ import annotations

import logging
import time

import pytest
import torch
import torch.nn.functional as F

from npuspeed.ops import _dispatch, fused_choice, fused_table
from npuspeed.ops.choose import trial as trials
from npuspeed.ops.fused_choice import Chooser


class FakeTimes:
    """trial(name, run): runs the candidate and returns its fixed time (`default` for others)."""

    def __init__(self, default=5.0, **seconds):
        self.seconds, self.default = seconds, default

    def __call__(self, name, run):
        run()
        return self.seconds.get(name, self.default)


@pytest.fixture
def chooser(monkeypatch):
    fresh = Chooser(repeats=2, budget_s=0.0)
    monkeypatch.setattr(fused_choice, "CHOOSER", fresh)
    monkeypatch.setattr(fused_choice, "_COMPILED", {})
    monkeypatch.setattr(fused_choice, "_COMPILE_FAILED", [])
    monkeypatch.setattr(fused_choice, "_LIGER", {})
    monkeypatch.delenv(fused_choice.FORCE_ENV, raising=False)
    monkeypatch.delenv(fused_choice.COMPILE_ENV, raising=False)
    _dispatch.reset_calls()
    return fresh


def _x(*shape, grad=True):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    return x.requires_grad_(grad)


def _glu(x):
    from npuspeed.ops.swiglu import fused_swiglu, swiglu_reference

    return fused_swiglu(x, {"megatron": swiglu_reference})


def _fake_compile(monkeypatch, broken: bool = False):
    """torch.compile replaced by a wrapper that records its calls (or raises like a missing toolchain)."""
    made = []

    def compile_(fn, **kw):
        made.append(fn)

        def run(*args):
            if broken:
                raise RuntimeError("InductorError: no working C++ compiler found")
            return fn(*args)

        return run

    monkeypatch.setattr(torch, "compile", compile_)
    return made


def test_compile_is_offered_on_accelerators_by_default_and_on_cpu_when_asked(chooser, monkeypatch):
    from npuspeed.ops import swiglu

    _fake_compile(monkeypatch)
    x = _x(4, 8)
    assert "compile" not in swiglu.candidates(x, {"megatron": swiglu.swiglu_reference})  # auto: not on a CPU
    monkeypatch.setattr(fused_choice._dispatch, "on_host", lambda *t: False)  # as on an accelerator
    assert "compile" in swiglu.candidates(x, {"megatron": swiglu.swiglu_reference})
    monkeypatch.setenv(fused_choice.COMPILE_ENV, "0")
    assert "compile" not in swiglu.candidates(x, {"megatron": swiglu.swiglu_reference})
    monkeypatch.setenv(fused_choice.COMPILE_ENV, "maybe")
    with pytest.raises(ValueError, match="NPUSPEED_FUSED_OP_COMPILE='maybe'"):
        swiglu.candidates(x, {"megatron": swiglu.swiglu_reference})


def test_compile_is_picked_where_fastest_and_reported(chooser, monkeypatch):
    made = _fake_compile(monkeypatch)
    monkeypatch.setenv(fused_choice.COMPILE_ENV, "1")
    chooser.trial = FakeTimes(megatron=3.0, cpp=2.0, compile=1.0)
    x = _x(6, 16)
    out = _glu(x)
    assert torch.allclose(out, F.silu(x[:, :8]) * x[:, 8:])
    assert made and _dispatch.calls() == {("swiglu", "compile"): 1}
    (choice,) = fused_choice.choices()
    assert choice.impl == "compile" and "compile" in choice.offered and set(choice.first_ms) >= {"compile", "megatron"}
    from npuspeed import reporting

    # other tests' choosers of the same name (the MoE kernels') may still hold records: this op's row
    (row,) = [c for c in reporting._path_choices() if c["chooser"] == "fused ops" and c["op"] == "swiglu"]
    assert row["impl"] == "compile" and "compile" in row["candidates"] and "compile" in row["first_ms"]
    chooser.clear()
    chooser.trial = FakeTimes(megatron=1.0, cpp=2.0, compile=3.0)
    _glu(x)
    assert fused_choice.choices()[0].impl == "megatron"


def test_a_failing_compile_is_dropped_with_one_log_line(chooser, monkeypatch, caplog):
    _fake_compile(monkeypatch, broken=True)
    monkeypatch.setenv(fused_choice.COMPILE_ENV, "1")
    notes = []
    chooser.notify = notes.append
    chooser.trial = FakeTimes(megatron=3.0, cpp=2.0, compile=1.0)
    with caplog.at_level(logging.WARNING, logger="npuspeed"):
        _glu(_x(6, 16))
        _glu(_x(6, 32))  # a second shape: compile is no longer offered, nothing more is said
    first, second = fused_choice.choices()
    assert first.impl != "compile" and "no working C++ compiler" in first.dropped["compile"]
    assert "compile" not in second.offered and "compile" not in second.dropped
    assert len([r for r in caplog.records if "torch.compile failed" in r.getMessage()]) == 1
    assert len([n for n in notes if "compile dropped" in n]) == 1
    assert "no working C++ compiler" in fused_choice.compile_failure()


def test_real_torch_compile_on_cpu_is_checked_and_can_win(chooser, monkeypatch):
    """inductor's C++ backend on this host: the compiled silu(a) * b runs in the warm-up (its
    compile is the first call, kept apart), agrees with Megatron's, and wins on its timing."""
    monkeypatch.setenv(fused_choice.COMPILE_ENV, "1")
    chooser.trial = FakeTimes(megatron=3.0, cpp=2.0, compile=1.0)
    x = _x(4, 16, grad=False)  # forward only: a compile of seconds, not of a backward graph too
    out = _glu(x)
    (choice,) = fused_choice.choices()
    assert choice.impl == "compile", choice.line()
    assert torch.allclose(out, F.silu(x[:, :8]) * x[:, 8:], atol=1e-6)
    assert choice.first_ms["compile"] > choice.first_ms["megatron"]


def test_a_first_call_s_compile_never_decides_the_pick(monkeypatch):
    """The 2026-11-27 H100 pick: the warm-up's first call (Triton's JIT there) was taken as the
    sample once the warm-up cost more than the budget, so the kernel that compiled lost. Here a
    candidate whose first call sleeps (wall time, like a JIT) and then is 20x cheaper wins."""
    monkeypatch.setattr(fused_choice, "CHOOSER", Chooser())
    monkeypatch.delenv(fused_choice.FORCE_ENV, raising=False)
    a = torch.randn(96, 96)
    state = {"first": True}

    def heavy(x):  # the same result as `jitted`, at 20x its work
        for _ in range(19):
            (x @ a).sum()
        return x @ a / 96

    def jitted(x):
        if state["first"]:
            state["first"] = False
            time.sleep(0.3)  # over the chooser's 0.2 s budget, as a Triton compile is
        return x @ a / 96

    x = torch.randn(96, 96)
    choice = fused_choice.choose("test_op", {"megatron": heavy, "fast": jitted}, (x,), chooser=fused_choice.CHOOSER)
    assert choice.impl == "fast", choice.line()
    assert "first call (compile/JIT, not counted) fast" in choice.why  # kept apart, named


def test_an_unconfigured_chooser_synchronizes_the_device(monkeypatch):
    """The 2026-11-27 bench's chooser was never pointed at the GPU: no synchronize, no events,
    so it timed kernel launches. The clock's default now is torch's accelerator synchronize."""
    synced = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: synced.append(1))
    clock = Chooser().clock
    assert clock.sync is trials.device_sync
    clock.sync()
    assert synced == [1]


# --- Liger-Kernel, through stand-ins of its three autograd functions (the real one needs a GPU) ---

class FakeLigerRMSNorm:
    calls = []

    @staticmethod
    def apply(x, w, eps, offset, casting_mode, in_place):
        FakeLigerRMSNorm.calls.append((offset, casting_mode, in_place))
        return F.rms_norm(x, (x.shape[-1],), w, eps)


class FakeLigerSiLUMul:
    @staticmethod
    def apply(a, b):
        assert a.is_contiguous() and b.is_contiguous()  # Liger's kernels need their own rows
        return F.silu(a) * b


class FakeLigerRope:
    """LigerRopeFunction's contract: HF layout [b, h, s, d], cos/sin [1, s, d]; like Liger it
    rotates in the storage of q.transpose(1, 2).contiguous() (the caller's, when that is a no-op)."""

    @staticmethod
    def apply(q, k, cos, sin):
        outs = []
        for t in (q, k):
            t = t.transpose(1, 2).contiguous()  # [b, s, h, d]
            c, s_ = cos[:, :, None, :], sin[:, :, None, :]
            x1, x2 = t.chunk(2, dim=-1)
            rotated = t * c + torch.cat((-x2, x1), dim=-1) * s_
            with torch.no_grad():
                t.copy_(rotated)  # in place, as the kernel writes
            outs.append(rotated.transpose(1, 2))
        return tuple(outs)


@pytest.fixture
def liger(chooser, monkeypatch):
    monkeypatch.setattr(fused_choice, "TRITON_ON_HOST", True)
    from npuspeed.ops.triton import _runtime

    monkeypatch.setattr(_runtime, "runs_on", lambda *t: True)
    monkeypatch.setattr(fused_choice, "_LIGER", {"rms_norm": FakeLigerRMSNorm, "swiglu": FakeLigerSiLUMul,
                                                "rope": FakeLigerRope})
    return chooser


def test_liger_is_not_imported_at_module_top():
    import npuspeed.ops.fused_choice as module
    import inspect

    assert "import liger" not in inspect.getsource(module).split("def _liger_import")[0]


def test_liger_rmsnorm_and_swiglu_are_candidates_and_picked_where_fastest(liger):
    from npuspeed.ops.rms_norm import fused_rms_norm

    liger.trial = FakeTimes(megatron=3.0, cpp=2.0, triton=2.0, liger=1.0)
    x, w = _x(6, 16), torch.ones(16, requires_grad=True)
    out = fused_rms_norm(x, w, 1e-5, lambda x, w: F.rms_norm(x, (16,), w, 1e-5))
    assert torch.allclose(out, F.rms_norm(x, (16,), w, 1e-5))
    assert FakeLigerRMSNorm.calls[-1] == (0.0, "gemma", False)
    y = _x(3, 2, 16)
    assert torch.allclose(_glu(y), F.silu(y[..., :8]) * y[..., 8:])
    assert _dispatch.calls() == {("rms_norm", "liger"): 1, ("swiglu", "liger"): 1}


def test_a_liger_kernel_that_disagrees_is_not_chosen(liger, monkeypatch):
    class Wrong:
        @staticmethod
        def apply(a, b):
            return F.silu(a) * b * 1.1

    monkeypatch.setitem(fused_choice._LIGER, "swiglu", Wrong)
    liger.trial = FakeTimes(megatron=3.0, cpp=2.0, liger=1.0)
    _glu(_x(6, 16))
    (choice,) = fused_choice.choices()
    assert choice.impl == "cpp" and "output differs" in choice.dropped["liger"]


def test_liger_rope_takes_megatrons_layout_and_leaves_q_and_k_alone(liger):
    from npuspeed.ops import rope

    s, b, d = 6, 1, 8
    q, k = _x(s, b, 4, d), _x(s, b, 2, d)
    freqs = fused_table.rope_freqs(s, d, "cpu")
    q0, k0 = q.detach().clone(), k.detach().clone()
    fn = fused_choice.liger("rope", q, k, freqs)
    assert fn is FakeLigerRope and rope.liger_fits(q, k, freqs, False)
    assert not rope.liger_fits(q, k, freqs, True) and not rope.liger_fits(q, k, freqs[..., :4], False)
    q_out, k_out = rope._liger_qk(fn, q, k, freqs, 1.0)
    assert torch.allclose(q_out, rope.rotary_pos_emb_reference(q, freqs), atol=1e-6)
    assert torch.allclose(k_out, rope.rotary_pos_emb_reference(k, freqs), atol=1e-6)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # batch 1: Liger's in-place write went to a copy


# --- the kernel table is the chooser's own measurement ---

MODEL = fused_table.Model(hidden=32, ffn=48, heads=4, groups=2, seq=8)


def _flag_calls(dtype=torch.float32):
    """The three flags' calls at MODEL's shapes, through the features' own wrappers of Megatron."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    from megatron.core.models.common.embeddings import rope_utils

    from npuspeed.features.fused_rmsnorm.rmsnorm import FusedRMSNorm
    from npuspeed.features.fused_rotary_pos_emb import rope as rope_feature
    from npuspeed.features.fused_swiglu import swiglu as swiglu_feature

    dims = fused_table.shapes(MODEL)
    norm = torch.nn.RMSNorm(MODEL.hidden, eps=fused_table.EPS, dtype=dtype)
    norm.__class__ = FusedRMSNorm
    norm(_x(*dims["rms_norm"]).to(dtype))
    swiglu_feature.fused_bias_swiglu(bias_swiglu_impl)(_x(*dims["swiglu"]).to(dtype), None)
    bshd = rope_feature.fused_bshd(rope_utils._apply_rotary_pos_emb_bshd)
    freqs = fused_table.rope_freqs(MODEL.seq, MODEL.kv_channels, "cpu")
    bshd(_x(*dims["rope_q"]).to(dtype), freqs)
    bshd(_x(*dims["rope_k"]).to(dtype), freqs)


@pytest.mark.parametrize("winner", ["megatron", "cpp", "megatron_fused"])
def test_the_kernel_table_and_the_flags_make_the_same_choice(chooser, winner):
    """One fake timer in both: the table (the device report's) and the flags' chooser measure the
    same keys with the same candidates and pick the same, per op and shape."""
    times = dict(megatron=3.0, megatron_fused=3.5, cpp=2.0, native=4.0)
    times[winner] = 0.5
    chooser.trial = FakeTimes(**times)
    _flag_calls()
    table = Chooser(repeats=2, budget_s=0.0, trial=FakeTimes(**times))
    rows = fused_table.measure(MODEL, torch.float32, "cpu", table)
    assert set(table.choices) == set(chooser.choices), "the table timed other keys than the flags"
    for key, row in table.choices.items():
        flag = chooser.choices[key]
        assert (row.impl, sorted(row.offered), row.ms) == (flag.impl, sorted(flag.offered), flag.ms), key
    assert len(rows) == 4 and {r.op for r in rows} == {"rms_norm", "swiglu", "rotary_pos_emb"}
    assert any(r.impl == winner for r in rows)
