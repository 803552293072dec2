"""--moe-alltoall-overlap-comm's step trial without processes: whole schedule calls alternate the
chunked layer and Megatron's, the faster by the ranks' summed times is kept (a record, one log
line when Megatron's wins), evaluation takes the decision, the variable forces one, and
--deterministic-mode keeps the chunked path untimed."""
from __future__ import annotations

import pytest
import torch

from npuspeed.features.moe_alltoall_overlap import candidates
from npuspeed.ops.choose import step_trial
from npuspeed.ops.choose.record import MEGATRON


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(step_trial, "_CHOOSERS", {})
    monkeypatch.setattr(candidates, "_TRIALS", {})
    monkeypatch.setattr(candidates, "_state", {"mode": candidates.CHUNKED, "decided": candidates.CHUNKED, "depth": 0})
    monkeypatch.delenv(candidates.FORCE_ENV, raising=False)
    clock = {"now": 0.0}
    monkeypatch.setattr(step_trial.time, "perf_counter", lambda: clock["now"])
    return clock


def _schedule(clock, times, seen):
    """A stand-in for Megatron's forward_backward_* with fake step times per path."""

    def forward_backward_no_pipelining(*, forward_step_func=None, data_iterator=None, model=None,
                                       num_microbatches=1, seq_length=None, micro_batch_size=None,
                                       forward_only=False):
        path = candidates.CHUNKED if candidates.chunked_now() else MEGATRON
        seen.append(("eval " if forward_only else "") + path)
        clock["now"] += times[path].pop(0) if times.get(path) else 1.0

    return forward_backward_no_pipelining


def _steps(clock, times, calls=8, evaluate_at=()):
    seen, notes = [], []
    step = candidates.step_wrapper(notes.append)(_schedule(clock, times, seen))
    for i in range(calls):
        step(num_microbatches=4, forward_only=i in evaluate_at)
    return seen, notes


def test_megatrons_layer_runs_where_chunking_loses(fresh):
    seen, notes = _steps(fresh, {candidates.CHUNKED: [5.0, 3.0, 3.0], MEGATRON: [2.0, 2.0]}, evaluate_at=(6,))
    assert seen[:5] == ["chunked", "megatron", "chunked", "megatron", "chunked"]  # set-up, then alternate
    assert seen[5:] == ["megatron", "eval megatron", "megatron"]
    made = candidates.chooser().choices[(4,)]
    assert made.impl == MEGATRON and made.ms == {"chunked": 3000.0, MEGATRON: 2000.0}
    assert len(notes) == 1 and "Megatron's unchunked MoE layer runs for 4 micro-batches" in notes[0]
    assert not candidates.chunked_now()  # outside a step too, the decision holds


def test_chunking_kept_where_it_is_faster(fresh):
    seen, notes = _steps(fresh, {candidates.CHUNKED: [5.0, 1.0, 1.0], MEGATRON: [2.0, 2.0]}, evaluate_at=(1,))
    assert seen[1] == "eval chunked"  # before a decision, evaluation takes the chunked path untimed
    assert seen[6:] == ["chunked"] * 2 and notes == []
    assert candidates.chooser().choices[(4,)].impl == candidates.CHUNKED


def test_forcing_variable_and_deterministic_mode(fresh, monkeypatch):
    monkeypatch.setenv(candidates.FORCE_ENV, "megatron")
    seen, _ = _steps(fresh, {}, calls=3)
    assert seen == ["megatron"] * 3 and "forced by" in candidates.chooser().choices[(4,)].why
    monkeypatch.setenv(candidates.FORCE_ENV, "sometimes")
    monkeypatch.setattr(candidates, "_TRIALS", {})
    with pytest.raises(ValueError, match="NPUSPEED_A2A_OVERLAP_PATH='sometimes'"):
        _steps(fresh, {}, calls=1)
    monkeypatch.delenv(candidates.FORCE_ENV)
    monkeypatch.setattr(step_trial, "_CHOOSERS", {})
    monkeypatch.setattr(candidates, "_TRIALS", {})
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    seen, _ = _steps(fresh, {candidates.CHUNKED: [9.0] * 5, MEGATRON: [1.0] * 5}, calls=5)
    assert seen == ["chunked"] * 5 and "--deterministic-mode" in candidates.chooser().choices[(4,)].why
