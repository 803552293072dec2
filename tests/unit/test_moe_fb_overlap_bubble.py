"""The pipeline bubble clock: idle time blocked in pipeline send/receive per step, F and B from
lone forward/backward calls only (a pair's overlapping halves are left out), the formula
(PP-1)(F+B) beside it."""
from __future__ import annotations

import threading
import time

import pytest

from npuspeed.features.moe_fb_overlap import bubble


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 2)
    bubble.reset()
    yield
    bubble.reset()


def _sleep(seconds):
    def run(*args, **kwargs):
        time.sleep(seconds)
    return run


def test_idle_forward_backward_and_the_formula():
    schedule = bubble.schedule_wrapper(lambda *a, **k: None)
    communicate = bubble.communicate_wrapper(_sleep(0.03))
    forward = bubble.forward_step_wrapper(_sleep(0.02))
    backward = bubble.backward_step_wrapper(_sleep(0.04))
    assert bubble.summary() is None  # no step yet
    for _ in range(2):
        schedule(forward_step_func=None, data_iterator=None, model=[object(), object()], num_microbatches=4)
        communicate(wait_on_reqs=True)
        communicate(wait_on_reqs=False)  # --overlap-p2p-comm: the wait is elsewhere, not counted
        forward()
        backward()
    s = bubble.summary()
    assert s["steps"] == 2 and s["pp"] == 2 and s["vpp"] == 2 and s["waits"] == 2
    assert 30 <= s["idle_ms_per_step"] < 45
    assert 20 <= s["forward_ms"] < 30 and 40 <= s["backward_ms"] < 55
    assert s["formula_ms"] == pytest.approx(s["forward_ms"] + s["backward_ms"])
    assert s["measured_over_formula"] == pytest.approx(s["idle_ms_per_step"] / s["formula_ms"])
    assert "measured/formula" in bubble.line(s)


def test_a_pairs_halves_are_not_one_chunks_cost():
    bubble.schedule_wrapper(lambda *a, **k: None)(None, None, model=[object()], num_microbatches=2)
    forward = bubble.forward_step_wrapper(_sleep(0.05))
    backward = bubble.backward_step_wrapper(_sleep(0.05))
    worker = threading.Thread(target=backward)
    worker.start()
    forward()  # runs while the backward does
    worker.join()
    s = bubble.summary()
    assert s["forward_ms"] is None and s["backward_ms"] is None and s["formula_ms"] is None
    forward()  # alone: counted
    assert bubble.summary()["forward_ms"] >= 50


def test_forward_only_is_not_a_step():
    bubble.schedule_wrapper(lambda *a, **k: None)(None, None, model=[object()], num_microbatches=2, forward_only=True)
    assert bubble.summary() is None
