"""The pipeline bubble clock (npuspeed/features/pipeline/bubble/): idle time blocked in pipeline
send/receive per step, F and B from lone forward/backward calls only (a pair's overlapping halves
are left out), the formula (PP-1)(F+B) beside it."""
from __future__ import annotations

import threading
import time

import pytest

from npuspeed.features.pipeline.bubble import measure
from npuspeed.features.pipeline.bubble.summary import line, summary


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 2)
    measure.reset()
    yield
    measure.reset()


def _sleep(seconds):
    def run(*args, **kwargs):
        time.sleep(seconds)
    return run


def test_idle_forward_backward_and_the_formula():
    schedule = measure.schedule_wrapper(lambda *a, **k: None)
    communicate = measure.communicate_wrapper(_sleep(0.03))
    forward = measure.forward_step_wrapper(_sleep(0.02))
    backward = measure.backward_step_wrapper(_sleep(0.04))
    assert summary() is None  # no step yet
    for _ in range(2):
        schedule(forward_step_func=None, data_iterator=None, model=[object(), object()], num_microbatches=4)
        communicate(wait_on_reqs=True)
        communicate(wait_on_reqs=False)  # --overlap-p2p-comm: the wait is elsewhere, not counted
        forward()
        backward()
    s = summary()
    assert s["steps"] == 2 and s["pp"] == 2 and s["vpp"] == 2 and s["waits"] == 2
    assert 30 <= s["idle_ms_per_step"] < 45
    assert 20 <= s["forward_ms"] < 30 and 40 <= s["backward_ms"] < 55
    assert s["formula_ms"] == pytest.approx(s["forward_ms"] + s["backward_ms"])
    assert s["measured_over_formula"] == pytest.approx(s["idle_ms_per_step"] / s["formula_ms"])
    assert "measured/formula" in line(s)


class _Work:
    def __init__(self, seconds):
        self.seconds = seconds

    def wait(self):
        time.sleep(self.seconds)
        return True


def test_deferred_waits_of_overlap_p2p_comm_are_the_idle_time():
    """--overlap-p2p-comm: _communicate returns its requests unwaited; each later wait is timed."""
    schedule = measure.schedule_wrapper(lambda *a, **k: None)
    communicate = measure.communicate_wrapper(lambda **k: (None, None, {"recv_prev": _Work(0.03),
                                                                       "send_next": _Work(0.0)}))
    for _ in range(2):
        schedule(forward_step_func=None, data_iterator=None, model=[object(), object()], num_microbatches=4)
        _, _, reqs = communicate(wait_on_reqs=False)
        assert summary() is None or summary()["waits"] % 2 == 0  # not counted until waited on
        assert reqs["recv_prev"].wait() is True and reqs["send_next"].seconds == 0.0  # the request's own answers
        reqs["send_next"].wait()
    s = summary()
    assert s["waits"] == 4 and 30 <= s["idle_ms_per_step"] < 45


def test_a_pairs_halves_are_not_one_chunks_cost():
    measure.schedule_wrapper(lambda *a, **k: None)(None, None, model=[object()], num_microbatches=2)
    forward = measure.forward_step_wrapper(_sleep(0.05))
    backward = measure.backward_step_wrapper(_sleep(0.05))
    worker = threading.Thread(target=backward)
    worker.start()
    forward()  # runs while the backward does
    worker.join()
    s = summary()
    assert s["forward_ms"] is None and s["backward_ms"] is None and s["formula_ms"] is None
    forward()  # alone: counted
    assert summary()["forward_ms"] >= 50


def test_forward_only_is_not_a_step():
    measure.schedule_wrapper(lambda *a, **k: None)(None, None, model=[object()], num_microbatches=2, forward_only=True)
    assert summary() is None


def test_aligned_steps_drop_transfers_add_the_tail_and_take_the_median(monkeypatch):
    """NPUSPEED_MEASURE_BUBBLE=1: each wait loses one exchange's time (hop), each step gains the
    wait for the pipeline's last op (this rank ends 10 ms before its peer) and loses the stage
    imbalance (the peer was busy 4 ms longer), and a stall of the host in one step (a 200 ms
    wait) does not move the median step."""
    import torch.distributed as dist

    monkeypatch.setenv(measure.MEASURE_ENV, "1")
    monkeypatch.setattr("megatron.core.parallel_state.get_pipeline_model_parallel_group", lambda: None)
    monkeypatch.setattr(dist, "barrier", lambda group=None: None)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    # the peer ends 10 ms later and was busy 4 ms longer
    monkeypatch.setattr(dist, "all_gather_object", lambda out, mine, group=None: out.__setitem__(
        slice(None), [mine, (mine[0] + 0.010, mine[1] + 0.004)]))
    monkeypatch.setattr(measure, "_exchange_seconds", lambda kwargs, group: 0.002)
    monkeypatch.setitem(measure._clock, "hop", None)
    forward = measure.forward_step_wrapper(_sleep(0.01))
    backward = measure.backward_step_wrapper(_sleep(0.01))
    for wait in (0.03, 0.2, 0.03):
        def step(*a, wait=wait, **k):
            forward()
            measure.communicate_wrapper(_sleep(wait))()
            backward()
            measure.communicate_wrapper(_sleep(0.001))()  # shorter than one exchange: all transfer
            forward()
            measure.communicate_wrapper(_sleep(0.005))()
            backward()
        measure.schedule_wrapper(step)(model=[object()], num_microbatches=2)
    s = summary()
    assert s["hop_ms"] == pytest.approx(2.0) and s["steps"] == 3 and s["waits"] == 9
    assert s["tail_ms_per_step"] == pytest.approx(10.0, abs=0.5)
    assert s["imbalance_ms_per_step"] == pytest.approx(4.0, abs=0.5)
    assert s["transfer_ms_per_step"] == pytest.approx(2.0 + 1.0 + 2.0, rel=0.3)
    # median step: 30 ms wait - 2 ms transfer + ~1 ms - ~1 ms transfer + 5 ms - 2 ms + 10 ms tail - 4 ms
    assert 35 <= s["bubble_ms_per_step"] < 44, s
    assert s["idle_ms_per_step"] > 80  # the mean keeps the stall
    assert s["bubble_over_formula"] == pytest.approx(s["bubble_ms_per_step"] / s["formula_ms"])
    assert "waiting for the pipeline's end" in line(s)
    # before the first backward: warm-up; after it, with forwards to come: steady; after the last: cool-down
    phases = s["idle_ms_per_step_by_phase"]
    assert phases["warm_up"] == pytest.approx((30 + 200 + 30) / 3, rel=0.15)
    assert 1 <= phases["steady"] < 4 and 5 <= phases["cool_down"] < 9, phases
