"""A forced kernel that disagrees with Megatron's path fails instead of running (issue 34): the
rule (npuspeed/ops/fused_choice.py) drops such a candidate when it measures, and says so once;
forced by NPUSPEED_FUSED_OP_PATH or taken unmeasured under --deterministic-mode, it is checked
once per shape against Megatron's output and raises, naming the op, the path and the gap. The
MoE permute pair goes through the same rule."""
from __future__ import annotations

import pytest
import torch

from npuspeed.ops import _dispatch, fused_choice
from npuspeed.ops._extension import has_op
from npuspeed.ops.fused_choice import Chooser, ForcedKernelDisagrees


def _times(name, run):
    """Injected timings: every kernel faster than Megatron's path, so a kept one wins."""
    run()
    return 2.0 if name == "megatron" else 1.0


@pytest.fixture
def chooser(monkeypatch):
    fresh = Chooser(repeats=1, budget_s=0.0, trial=_times)
    monkeypatch.setattr(fused_choice, "CHOOSER", fresh)
    monkeypatch.delenv(fused_choice.FORCE_ENV, raising=False)
    _dispatch.reset_calls()
    return fresh


def _run(op="rms_norm", shape=(8, 16), **cands):
    x = torch.randn(*shape, requires_grad=True)
    return fused_choice.run_chosen(op, {"megatron": lambda t: t * 2, **cands}, (x,))


@pytest.mark.parametrize("how", ["env", "deterministic"])
def test_a_forced_kernel_that_disagrees_raises_with_op_path_and_gap(chooser, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv(fused_choice.FORCE_ENV, "cpp")
    else:
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    with pytest.raises(ForcedKernelDisagrees, match=r"fused rms_norm \[8x16 fp32 cpu\]: cpp \((forced by "
                       r"NPUSPEED_FUSED_OP_PATH=cpp|--deterministic-mode).*disagrees with Megatron's path: "
                       r"max \|diff\| \d"):
        _run(cpp=lambda t: t * 2 + 0.5)
    assert _dispatch.calls() == {} and chooser.choices == {}  # nothing ran, nothing cached


def test_a_forced_kernel_that_agrees_runs_and_is_checked_once(chooser, monkeypatch):
    monkeypatch.setenv(fused_choice.FORCE_ENV, "npuspeed")
    seen = []
    for _ in range(3):
        out = _run(cpp=lambda t: seen.append(1) or t + t)
    out.sum().backward()
    assert len(seen) == 4  # one check, three calls
    assert _dispatch.calls() == {("rms_norm", "cpp"): 3}
    with pytest.raises(ForcedKernelDisagrees, match=r"part 1: max \|diff\|"):  # tuples: each part is checked
        fused_choice.run_chosen("rope", {"megatron": lambda a: (a, a * 2), "cpp": lambda a: (a, a * 3)},
                                (torch.ones(3, 5),))
    with pytest.raises(ForcedKernelDisagrees, match=r"\(4, 8\) torch.float32 where Megatron gives \(8, 4\)"):
        _run(shape=(8, 4), cpp=lambda t: (t * 2).T.contiguous())


def test_unforced_a_disagreeing_kernel_is_dropped_and_said_once(chooser):
    notes = []
    chooser.configure(notify=notes.append)
    for shape in ((8, 16), (4, 16), (8, 16)):
        _run(shape=shape, cpp=lambda t: t * 2 + 1, triton=lambda t: t * 2)
    assert _dispatch.calls() == {("rms_norm", "triton"): 3}
    dropped = [c.dropped["cpp"] for c in fused_choice.choices()]
    assert dropped == ["output differs from Megatron's (max |diff| 1 (tolerance 0.0001 abs + 0.0001 rel))"] * 2
    assert len(notes) == 1 and notes[0].startswith("fused rms_norm: cpp dropped for 8x16 fp32 cpu: output differs")


@pytest.mark.skipif(not has_op("moe_permute"), reason="C++ op library not built")
def test_a_forced_moe_permute_pair_that_disagrees_raises(chooser, monkeypatch):
    from megatron.core.transformer.moe import moe_utils

    from npuspeed.features.moe_fused_permute import permute as feature

    monkeypatch.setenv(fused_choice.FORCE_ENV, "cpp")
    real = feature.moe_unpermute
    monkeypatch.setattr(feature, "moe_unpermute", lambda *a, **kw: real(*a, **kw) * 1.5)
    permute, _ = (w(f) for w, f in zip(feature.wrappers(), (moe_utils.permute, moe_utils.unpermute)))
    rmap = torch.zeros(6, 4, dtype=torch.bool)
    rmap[torch.arange(6), torch.arange(6) % 4] = True
    with pytest.raises(ForcedKernelDisagrees, match=r"fused moe_permute \[6x8 fp32 cpu 4 experts, 6 rows\]: "
                       r"cpp \(forced by NPUSPEED_FUSED_OP_PATH=cpp\) disagrees .* max \|diff\|"):
        permute(torch.randn(6, 8), rmap, num_out_tokens=6)
    monkeypatch.setattr(feature, "moe_unpermute", real)  # the same call with the real pair runs it
    permute(torch.randn(6, 8), rmap, num_out_tokens=6)
    assert _dispatch.calls()[("moe_permute", "cpp")] == 1


def test_a_forced_kernel_runs_unchecked_where_megatrons_path_cannot_run(chooser, monkeypatch):
    monkeypatch.setenv(fused_choice.FORCE_ENV, "cpp")

    def megatron(t):
        raise NotImplementedError("no such case upstream")

    fused_choice.run_chosen("op", {"megatron": megatron, "cpp": lambda t: t + 1}, (torch.ones(2, 3),))
    (choice,) = fused_choice.choices()
    assert choice.impl == "cpp" and choice.why.endswith("not checked: Megatron's path raised NotImplementedError")
