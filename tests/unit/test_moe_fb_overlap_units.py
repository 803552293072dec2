"""--moe-fb-overlap's parts without processes: the two parties alternate strictly at each
passed turn (the order every rank issues its collectives in), an error on either side reaches
the caller, and the step trial takes the faster of paired and serial by the ranks' summed times."""
from __future__ import annotations

import pytest

from npuspeed.features.pipeline import pair_choice as choice
from npuspeed.features.pipeline import turns
from npuspeed.ops.choose import step_trial
from npuspeed.ops.choose.record import MEGATRON


def _pair(forward_steps: int, backward_steps: int):
    order = []

    def side(name, steps):
        def run():
            for i in range(steps):
                order.append(f"{name}{i}")
                turns.current().pass_turn()
            order.append(f"{name}-end")
            return name
        return run

    result = turns.run_pair(side("f", forward_steps), side("b", backward_steps))
    return result, order


def test_turns_alternate_backward_first():
    result, order = _pair(3, 3)
    assert result == "f"
    assert order == ["b0", "f0", "b1", "f1", "b2", "f2", "b-end", "f-end"]
    assert turns.current() is None


def test_a_side_that_ends_first_leaves_the_other_running_alone():
    _, order = _pair(1, 4)
    assert order == ["b0", "f0", "b1", "f-end", "b2", "b3", "b-end"]


def test_an_error_in_the_backward_reaches_the_caller():
    def backward():
        turns.current().pass_turn()
        raise RuntimeError("boom in backward")

    with pytest.raises(RuntimeError, match="boom in backward"):
        turns.run_pair(lambda: turns.current().pass_turn(), backward)
    assert turns.current() is None


def _trial(times: dict[str, list[float]], monkeypatch):
    """Run the step trial with fake step times (one list per mode, consumed in order)."""
    monkeypatch.setattr(step_trial, "_CHOOSERS", {})
    monkeypatch.delenv(choice.FORCE_ENV, raising=False)
    clock = {"now": 0.0}
    monkeypatch.setattr(step_trial.time, "perf_counter", lambda: clock["now"])
    trial, modes, notes = choice.StepTrial(4), [], []
    for _ in range(8):
        mode = trial.mode()
        modes.append(mode)

        def run(mode=mode):
            clock["now"] += times[mode].pop(0) if times[mode] else 1.0

        trial.timed(mode, run, lambda: None, lambda values: [2 * v for v in values], notes.append)
    return modes, choice.chooser().choices[trial.key], notes


def test_trial_keeps_pairing_where_it_is_faster(monkeypatch):
    modes, made, notes = _trial({"paired": [9.0, 1.0, 1.1], "serial": [2.0, 2.2]}, monkeypatch)
    assert modes[:5] == ["paired", "serial", "paired", "serial", "paired"]  # set-up, then alternate
    assert made.impl == "paired" and made.ms == {"paired": 2000.0, MEGATRON: 4000.0}  # fastest of 2, summed
    assert modes[5:] == ["paired"] * 3 and notes == []


def test_trial_falls_back_to_megatrons_loop_where_pairing_loses(monkeypatch):
    modes, made, notes = _trial({"paired": [1.0, 3.0, 3.0], "serial": [2.0, 2.0]}, monkeypatch)
    assert made.impl == MEGATRON
    assert modes[5:] == ["serial"] * 3
    assert len(notes) == 1 and "Megatron's serial schedule runs" in notes[0]


def test_forcing_variable(monkeypatch):
    monkeypatch.setattr(step_trial, "_CHOOSERS", {})
    monkeypatch.setenv(choice.FORCE_ENV, "serial")
    assert choice.StepTrial(2).mode() == "serial"
    monkeypatch.setenv(choice.FORCE_ENV, "sometimes")
    with pytest.raises(ValueError, match="NPUSPEED_FB_OVERLAP_PATH='sometimes'"):
        choice.StepTrial(3).mode()


class _Layer:
    use_shared_expert, shared_expert_overlap = True, False


def test_shared_experts_run_once_inside_the_combine_or_at_postprocess():
    from npuspeed.features.moe_fb_overlap import masking

    calls = []
    compute = masking.shared_experts_compute_wrapper(lambda layer, h: calls.append(h) or h * 2)
    post = masking.postprocess_wrapper(lambda layer, out, shared: out + shared)
    layer = _Layer()
    held = compute(layer, 3)
    assert isinstance(held, masking.Deferred) and calls == []  # held back, not computed
    assert masking.run_pending() == 1 and calls == [3]  # the combine computes it
    assert post(layer, 1, held) == 7 and calls == [3]  # postprocess takes the result: not computed twice
    other = compute(layer, 5)
    assert post(layer, 1, other) == 11 and calls == [3, 5]  # no combine ran it: postprocess computes it
    assert masking.run_pending() == 0  # and nothing is left held


def test_no_shared_expert_is_not_held():
    from npuspeed.features.moe_fb_overlap import masking

    layer = _Layer()
    layer.use_shared_expert = False
    assert masking.shared_experts_compute_wrapper(lambda layer, h: None)(layer, 3) is None
