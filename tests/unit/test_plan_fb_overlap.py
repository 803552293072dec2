"""`npuspeed plan --moe-fb-overlap`: the step with and without the forward/backward pairing at
the device's rates (npuspeed/plan/fb_overlap.py), its memory, and what it prints."""
from __future__ import annotations

import json

import pytest

from npuspeed.plan import cli, fb_overlap, interconnect
from npuspeed.plan.planner import plan

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
         "--micro-batch-size", "2", "--use-flash-attn", "--num-experts", "4", "--moe-router-topk", "2",
         "--disable-bias-linear", "--expert-model-parallel-size", "2", "--nproc-per-node", "2"]


def _plan(*flags, m=4, device="cuda"):
    p = plan([*MODEL, "--global-batch-size", str(2 * 2 * m), "--npuspeed-device", device, *flags], with_removes=False)
    assert p.ok, p.problems
    return p


def _links(monkeypatch, bytes_per_s: float) -> None:
    """Both links of the cuda entry at `bytes_per_s`, no latency: the all-to-all is bytes / rate."""
    monkeypatch.setitem(interconnect.LINKS, "cuda", interconnect.Links("a", bytes_per_s, "b", bytes_per_s, 0.0))


def test_pair_hides_each_all_to_all_up_to_the_compute_beside_it():
    # attention f 1, MLP f 2 (backward 2 and 4), dispatch 3, combine 1.5:
    # combine b | attention f: 1; dispatch f | MLP b: 3; dispatch b | MLP f: 2; combine f | attention b: 1.5
    assert fb_overlap.pair_hidden(1.0, 2.0, 3.0, 1.5) == pytest.approx(7.5)
    assert fb_overlap.pair_hidden(10.0, 10.0, 1.0, 1.0) == pytest.approx(4.0)  # all four hidden
    assert fb_overlap.pair_hidden(1.0, 1.0, 100.0, 100.0) == pytest.approx(6.0)  # the compute: 1 + 2 + 1 + 2


def test_all_to_all_priced_inside_and_between_nodes():
    links = interconnect.Links("a", 4.0, "b", 2.0, 0.5)
    # 64 bytes over a group of 4, 2 to a node: 16 to the node's other rank (4 s), 32 off the node (16 s)
    assert interconnect.all_to_all_seconds(links, 64, 4, 2) == pytest.approx(0.5 + 16.0)
    assert interconnect.all_to_all_seconds(links, 64, 4, 8) == pytest.approx(0.5 + 48 / 4)  # one node
    assert interconnect.all_to_all_seconds(links, 64, 1, 8) == 0.0


def test_compute_far_above_the_all_to_all_hides_all_but_the_first_and_last(monkeypatch):
    _links(monkeypatch, 1e30)
    f = _plan("--moe-fb-overlap").fb_overlap
    assert f.pairs == 3 and f.a2a > 0
    assert f.hidden_fraction == pytest.approx(3 / 4)
    assert f.step_with_s == pytest.approx(f.step_without_s - f.a2a_s * 3 / 4)


def test_all_to_all_far_above_the_compute_hides_only_the_compute(monkeypatch):
    _links(monkeypatch, 1e3)
    f = _plan("--moe-fb-overlap").fb_overlap
    assert f.a2a > 100 * (f.attention_f + f.mlp_f)
    # per pair and layer: the other micro-batch's whole forward and backward, 3 x (attention + MLP)
    assert f.hidden_s == pytest.approx(3 * 4 * 3 * (f.attention_f + f.mlp_f))
    assert f.hidden_fraction < 0.01 and f.ratio == pytest.approx(f.step_without_s / (f.step_without_s - f.hidden_s))


def test_one_micro_batch_hides_nothing_and_holds_no_more():
    one = _plan("--moe-fb-overlap", m=1)
    assert one.fb_overlap.pairs == 0 and one.fb_overlap.hidden_s == 0.0 and one.fb_overlap.ratio == 1.0
    assert one.ranks[0].in_flight == 1


def test_one_more_micro_batch_alive_at_pp1():
    off, on = _plan(), _plan("--moe-fb-overlap")
    assert off.fb_overlap is None
    assert (off.ranks[0].in_flight, on.ranks[0].in_flight) == (1, 2)
    assert on.peak - off.peak == pytest.approx(on.ranks[0].activation_per_microbatch[0], rel=0.05)


def test_megatrons_flag_is_the_same_prediction():
    a, b = _plan("--moe-fb-overlap").fb_overlap, _plan("--overlap-moe-expert-parallel-comm").fb_overlap
    assert a == b and a.ratio > 1.0


def test_cluster_size_and_device_change_the_price():
    one_node = _plan("--moe-fb-overlap").fb_overlap
    two_nodes = plan([*MODEL, "--global-batch-size", "16", "--npuspeed-device", "cuda", "--moe-fb-overlap",
                      "--nproc-per-node", "1", "--nnodes", "2"], with_removes=False).fb_overlap
    assert two_nodes.a2a > one_node.a2a  # the EP group crosses the network
    npu = _plan("--moe-fb-overlap", device="npu").fb_overlap
    assert npu.device == "npu" and npu.attention_f > one_node.attention_f


def test_printed_line_and_json_keys(capsys):
    argv = [*MODEL, "--global-batch-size", "16", "--npuspeed-device", "npu", "--moe-fb-overlap"]
    cli.main(argv)
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("--moe-fb-overlap at npu rates")]
    assert len(line) == 1 and " ms without, " in line[0] and "x; all-to-all" in line[0]
    cli.main(argv + ["--json"])
    out = json.loads(capsys.readouterr().out)
    f = out["moe_fb_overlap"]
    assert {"step_ms_without", "step_ms_with", "ratio", "a2a_ms", "a2a_hidden_ms", "a2a_hidden_fraction",
            "forward_backward_pairs", "device", "links"} <= set(f)
    assert f["ratio"] == pytest.approx(f["step_ms_without"] / f["step_ms_with"]) and f["device"] == "npu"
    assert {"peak_mem_bytes", "step_ms", "breakdown", "layout"} <= set(out)  # the old keys stay
    cli.main(argv[:-1] + ["--json"])
    assert json.loads(capsys.readouterr().out)["moe_fb_overlap"] is None


def test_pairs_at_pp1_and_in_the_interleaved_schedule():
    """PP 1 pairs all but the first forward; PP 2 x VPP 2 with 4 micro-batches: the first stage
    warms up 5 chunk steps (Megatron's 4 plus the extra one) and pairs 3 of its 8, as the
    4-rank parity run counts (24 pairs in 8 iterations)."""
    from npuspeed.features.moe_fb_overlap.plan import pairs_of

    assert pairs_of(4, 1, 1) == (3, 4)
    assert pairs_of(4, 2, 2) == (3, 8)
    assert pairs_of(2, 2, 2) == (0, 4)  # all warm-up: nothing to pair
