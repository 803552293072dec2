"""The swap sizing (npuspeed/offload/sizing.py) with a fake link and fake compute times, and the
host link's figures (npuspeed/accelerator/host_link.py).

Layers: each unit's copy out runs after its forward window, its fetch starts when the unit
above begins its backward (the top unit: when its own does). Chunks: a moved chunk comes in
while the previous moved chunk updates. Hidden mode moves what hides (with the 80% margin) and
names why the rest stays; whole mode moves everything and states the cost.
"""
from __future__ import annotations

import pytest

from npuspeed.accelerator import host_link
from npuspeed.offload import sizing
from npuspeed.offload.sizing import Chunk, LayerUnit

MB = 2**20


def _layers(n=4, nbytes=10 * MB, fwd=1e-3, bwd=2e-3):
    return [LayerUnit(f"layer{i + 1}", nbytes, fwd, bwd) for i in range(n)]


def _link(gbs, overlaps=True):
    return host_link.LinkFigures(gbs * 1e9, gbs * 1e9, overlaps, "fake link (test)")


def test_layers_that_hide_move_and_only_the_top_one_stays():
    # 10 MiB at 100 GB/s: 0.1 ms each way, far under the 1-2 ms windows
    d = sizing.size_layers("--swap-attention", "hidden", _layers(), _link(100))
    assert d.moved == ["layer1", "layer2", "layer3"]
    assert list(d.kept) == ["layer4"] and "top unit" in d.kept["layer4"]
    assert d.exposed_s == 0.0 and d.hidden_share == 1.0
    assert d.bytes_moved == 30 * MB and d.bytes_total == 40 * MB


def test_a_slow_link_moves_only_what_hides_and_says_so():
    # 10 MiB at 6 GB/s: 1.75 ms each way, 2.18 ms with the margin: each fetch fits a 2.5 ms
    # backward window, but the copies out queue behind 1 ms forward windows: the lower three move
    units = _layers(n=6, bwd=2.5e-3, fwd=1e-3)
    link = _link(6)
    d = sizing.size_layers("--swap-attention", "hidden", units, link)
    assert d.moved == ["layer1", "layer2", "layer3"] and len(d.kept) == 3
    moved = {i for i, u in enumerate(units) if u.name in d.moved}
    assert sizing.layers_wait(units, moved, link, sizing.MARGIN) <= sizing.EPS  # what moves hides
    for name, why in d.kept.items():  # every kept one would add a wait, and says so
        i = [u.name for u in units].index(name)
        assert sizing.layers_wait(units, moved | {i}, link, sizing.MARGIN) > sizing.EPS
        assert "would add" in why or "top unit" in why
    assert "keeps" in d.line() and "mode whole" in d.line()


def test_whole_moves_everything_and_states_its_cost():
    units, link = _layers(n=4), _link(2)  # 5.2 ms each way per unit: far from hidden
    d = sizing.size_layers("--swap-attention", "whole", units, link)
    assert d.moved == [u.name for u in units] and not d.kept
    assert d.exposed_s == pytest.approx(sizing.layers_wait(units, set(range(4)), link)) and d.exposed_s > 0.01
    line = d.line()
    assert "cost: about" in line and f"{d.exposed_s * 1e3:.2f} ms" in line and "not hidden" in line


def test_in_order_copies_never_hide():
    d = sizing.size_layers("--swap-attention", "hidden", _layers(), _link(1000, overlaps=False))
    assert d.moved == [] and all("in order" in why for why in d.kept.values())


def test_the_schedule_adds_the_top_fetch_and_a_late_copy_out():
    units, link = _layers(n=2, nbytes=1000, fwd=1.0, bwd=1.0), host_link.LinkFigures(1000, 1000, True, "t")
    # the top: copied out once its forward window ends (2..3 s), fetched on demand (3..4 s): 2 s
    assert sizing.layers_wait(units, {1}, link) == pytest.approx(2.0)
    assert sizing.layers_wait(units, {0}, link) == pytest.approx(0.0)  # out 1..2 s, in 2..3 s behind layer2's bwd
    slow = host_link.LinkFigures(500, 500, True, "t")  # 2 s each way: out 1..3, in 3..5, needed at 3
    assert sizing.layers_wait(units, {0}, slow) == pytest.approx(2.0)


def _chunks(n=4, nbytes=10 * MB, update=1e-3):
    return [Chunk(f"chunk{k}", nbytes, update) for k in range(n)]


def test_optimizer_chunks_that_hide_move_and_the_first_stays():
    d = sizing.size_chunks("--swap-optimizer", "hidden", _chunks(), _link(100), gap_s=1.0)
    assert d.moved == ["chunk1", "chunk2", "chunk3"] and list(d.kept) == ["chunk0"]
    assert d.exposed_s == 0.0 and d.per == "step"


def test_optimizer_slow_link_keeps_chunks_resident_and_whole_states_the_cost():
    chunks, link = _chunks(n=6), _link(8)  # 1.3 ms each way (1.6 with the margin) against 1 ms updates
    d = sizing.size_chunks("--swap-optimizer", "hidden", chunks, link, gap_s=1.0)
    moved = {k for k, c in enumerate(chunks) if c.name in d.moved}
    assert moved == {2, 4} and sizing.chunks_wait(chunks, moved, link, 1.0, sizing.MARGIN) <= sizing.EPS
    whole = sizing.size_chunks("--swap-optimizer", "whole", chunks, link, gap_s=1.0)
    assert len(whole.moved) == 6 and whole.exposed_s > 0.002 and "cost: about" in whole.line()
    # copies out that outlast the compute before the next step are a cost too
    assert sizing.chunks_wait(chunks, {5}, link, gap_s=0.0) > sizing.chunks_wait(chunks, {5}, link, gap_s=1.0)


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="hidden, whole"):
        sizing.size_layers("x", "all", _layers(), _link(1))


def test_link_fake_env_and_measured_on_the_cpu(monkeypatch):
    from npuspeed.accelerator.base import AcceleratorError
    from npuspeed.accelerator.cpu import CpuAccelerator

    acc = CpuAccelerator()
    with host_link.fake(1e9, 2e9) as f:
        assert host_link.link(acc) is f and host_link.known("cpu") is f
    monkeypatch.setenv(host_link.ENV, "26,24")
    got = host_link.link(acc)
    assert (got.to_device, got.to_host) == (26e9, 24e9) and not got.overlaps  # the CPU runs copies in order
    assert host_link.host_link_bytes_per_s("cuda") == 24e9  # the planner's figure follows it on every rank
    monkeypatch.setenv(host_link.ENV, "fast")
    with pytest.raises(AcceleratorError, match=host_link.ENV):
        host_link.link(acc)
    monkeypatch.delenv(host_link.ENV)
    measured = host_link.measure(acc, nbytes=MB, repeats=2)
    assert measured.to_device > 0 and not measured.overlaps and "memcpy" in measured.source


def test_a_decision_reaches_the_report_with_its_measured_wait():
    from npuspeed import reporting
    from npuspeed.offload import decisions

    decisions.reset()
    d = sizing.size_layers("--swap-attention", "hidden", _layers(), _link(100))
    decisions.record(d)
    (row,) = reporting._swap_sizing()
    assert row["exposed_ms_measured"] is None and row["moved"] == ["layer1", "layer2", "layer3"]
    decisions.checked(d, 0.5 * d.transfer_s, 1)
    (row,) = reporting._swap_sizing()
    assert row["hidden_share_measured"] == pytest.approx(0.5) and row["hidden_share_estimated"] == 1.0
    assert {"bytes_moved", "transfer_ms", "exposed_ms_estimated", "kept", "link", "line"} <= set(row)
    decisions.reset()
