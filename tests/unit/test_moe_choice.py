"""The MoE flags follow the fused-op rule: `--moe-grouped-gemm`'s grouped matmul and
`--use-fused-moe-token-permute-and-unpermute`'s fused pair run only where they measured
faster than the per-expert loop / Megatron's own permute (injected timings here: the
decision is deterministic), the counters show which ran, forcing works, and the result is
Megatron's either way."""
from __future__ import annotations

import pytest
import torch

from npuspeed import telemetry
from npuspeed.features.moe_grouped_gemm import grouped_gemm
from npuspeed.features.moe_fused_permute import permute as permute_feature
from npuspeed.ops import _dispatch, fused_choice
from npuspeed.ops._extension import has_op


class FakeTimes:
    def __init__(self, **seconds):
        self.seconds, self.calls = seconds, []

    def __call__(self, name, run):
        run()
        self.calls.append(name)
        return self.seconds[name]


@pytest.fixture
def chooser(monkeypatch):
    fresh = fused_choice.Chooser(repeats=2, budget_s=0.0)
    monkeypatch.setattr(fused_choice, "CHOOSER", fresh)
    monkeypatch.delenv(fused_choice.FORCE_ENV, raising=False)
    telemetry.reset("moe.grouped_gemm.")
    _dispatch.reset_calls()
    return fresh


def _gmm_inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 16, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(3, 16, 8, generator=gen).to(dtype).requires_grad_()
    return x, w, [5, 0, 7]


def _grouped_counts():
    return {k.rsplit(".", 1)[1]: v for k, v in telemetry.snapshot("moe.grouped_gemm.").items()}


@pytest.mark.parametrize("loop_s, torch_s, expected", [(1.0, 2.0, "linear"), (2.0, 1.0, "torch"), (1.0, 1.0, "linear")])
def test_grouped_mm_takes_the_faster_backend(chooser, loop_s, torch_s, expected):
    if grouped_gemm.backend_for(torch.empty(0)) != "torch":
        pytest.skip("torch grouped mm does not run here: only the loop exists")
    chooser.trial = FakeTimes(megatron=loop_s, torch=torch_s)
    x, w, counts = _gmm_inputs()
    for _ in range(2):
        out = grouped_gemm.grouped_mm(x, w, counts)
        out.sum().backward()
    assert _grouped_counts() == {expected: 2}  # trials count nothing
    (choice,) = fused_choice.choices()
    assert choice.op == "grouped_mm" and choice.label == "3 experts, ~16x16x8 fp32 cpu"
    assert choice.impl == ("megatron" if expected == "linear" else "torch")
    ref = torch.cat([x[:5] @ w[0], x[5:] @ w[2]])
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("winner", ["megatron", "loop_fp32"])
def test_bf16_grouped_mm_on_cpu_measures_the_fp32_loop(chooser, winner):
    """bf16 on a CPU: the loop in fp32 is a candidate (a CPU without bf16 GEMM units runs it
    10x faster), taken only where it measured faster; the result is the bf16 loop's to rounding."""
    has_torch = grouped_gemm.backend_for(torch.empty(0, dtype=torch.bfloat16)) == "torch"
    times = dict(megatron=2.0, loop_fp32=1.0 if winner == "loop_fp32" else 3.0)
    if has_torch:
        times["torch"] = 4.0
    chooser.trial = FakeTimes(**times)
    x, w, counts = _gmm_inputs(torch.bfloat16)
    out = grouped_gemm.grouped_mm(x, w, counts)
    out.float().sum().backward()
    assert _grouped_counts() == {("linear" if winner == "megatron" else "loop_fp32"): 1}
    assert set(chooser.trial.calls) == set(times)
    ref = torch.cat([x[:5] @ w[0], x[5:] @ w[2]])
    torch.testing.assert_close(out, ref, atol=5e-2, rtol=2e-2)


def test_grouped_mm_forced(chooser, monkeypatch):
    if grouped_gemm.backend_for(torch.empty(0)) != "torch":
        pytest.skip("torch grouped mm does not run here")
    chooser.trial = FakeTimes()  # a trial would raise: forced paths measure nothing
    x, w, counts = _gmm_inputs()
    monkeypatch.setenv(fused_choice.FORCE_ENV, "megatron")
    grouped_gemm.grouped_mm(x, w, counts)
    monkeypatch.setenv(fused_choice.FORCE_ENV, "npuspeed")
    grouped_gemm.grouped_mm(x, w, counts)
    assert _grouped_counts() == {"linear": 1, "torch": 1} and chooser.trial.calls == []


def test_grouped_mm_under_deterministic_mode_runs_the_grouped_kernel(chooser):
    """--deterministic-mode measures nothing and takes the flag's own kernel on every rank: for
    --moe-grouped-gemm that is the device's grouped matmul (torch's here), not the per-expert
    loop the flag replaces (which would make the flag do nothing under the mode)."""
    if grouped_gemm.backend_for(torch.empty(0)) != "torch":
        pytest.skip("torch grouped mm does not run here")
    chooser.trial = FakeTimes()  # a trial would raise: nothing is measured
    x, w, counts = _gmm_inputs()
    torch.use_deterministic_algorithms(True)
    try:
        grouped_gemm.grouped_mm(x, w, counts)
    finally:
        torch.use_deterministic_algorithms(False)
    assert _grouped_counts() == {"torch": 1} and chooser.trial.calls == []


def _routing(tokens=10, experts=4, topk=2, hidden=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(tokens, experts, generator=gen)
    top = scores.topk(topk, dim=-1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.where(routing_map, scores, torch.zeros_like(scores))
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
    return x, routing_map, probs, tokens * topk


@pytest.mark.skipif(not has_op("moe_permute"), reason="C++ op library not built")
@pytest.mark.parametrize("winner", ["cpp", "megatron"])
def test_permute_pair_takes_the_faster_and_matches_megatron(chooser, winner):
    from megatron.core.transformer.moe import moe_utils

    notes = []
    chooser.configure(notify=notes.append)
    chooser.trial = FakeTimes(megatron=1.0 if winner == "megatron" else 2.0, cpp=1.0 if winner == "cpp" else 2.0)
    permute = permute_feature.wrappers()[0](moe_utils.permute)
    unpermute = permute_feature.wrappers()[1](moe_utils.unpermute)
    x, routing_map, probs, n = _routing()

    def round_trip(perm, unperm, x):
        out, out_probs, order = perm(x, routing_map, probs=probs, num_out_tokens=n)[:3]
        back = unperm(out * out_probs.unsqueeze(-1), order, x.shape, routing_map=routing_map)
        back.sum().backward()
        return back

    got = round_trip(permute, unpermute, x)
    got_grad, x.grad = x.grad, None
    ref = round_trip(moe_utils.permute, moe_utils.unpermute, x)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(got_grad, x.grad)
    assert _dispatch.calls() == {("moe_permute", winner): 1, ("moe_unpermute", winner): 1}
    (choice,) = fused_choice.choices()
    assert choice.op == "moe_permute" and choice.impl == winner and set(choice.ms) == {"megatron", "cpp"}
    assert len(notes) == (1 if winner == "megatron" else 0)


@pytest.mark.skipif(not has_op("moe_permute"), reason="C++ op library not built")
def test_permute_forced_megatron(chooser, monkeypatch):
    from megatron.core.transformer.moe import moe_utils

    chooser.trial = FakeTimes()
    monkeypatch.setenv(fused_choice.FORCE_ENV, "megatron")
    permute = permute_feature.wrappers()[0](moe_utils.permute)
    unpermute = permute_feature.wrappers()[1](moe_utils.unpermute)
    x, routing_map, probs, n = _routing()
    out, _, order = permute(x, routing_map, probs=probs, num_out_tokens=n)[:3]
    unpermute(out, order, x.shape, routing_map=routing_map)
    assert _dispatch.calls() == {("moe_permute", "megatron"): 1, ("moe_unpermute", "megatron"): 1}


def test_an_expensive_op_is_timed_by_one_round_after_its_warm_up(monkeypatch):
    """A candidate pair whose first timed round already costs more than the budget (bf16 expert
    GEMMs on a CPU without bf16 units: seconds each) is decided on that one round: no more rounds
    that would make the step meeting the shape pay several times over. The warm-up itself is
    never the sample: a first call can hold a compile (Triton's JIT made the H100's fused-op pick
    of 2026-11-27 wrong, docs/fused_op_rule.md). Cheap ops keep their rounds."""
    calls = {"megatron": 0, "torch": 0}

    def candidate(name):
        def run(x):
            calls[name] += 1
            return x * 2
        return run

    x = torch.randn(8, 4, requires_grad=True)
    expensive = fused_choice.Chooser(repeats=3, budget_s=-1.0)  # every warm-up is over this budget
    expensive.pick("op", ("k",), "x", {"megatron": candidate("megatron"), "torch": candidate("torch")}, (x,))
    assert calls == {"megatron": 2, "torch": 2}  # the warm-up and one timed round
    calls.update(megatron=0, torch=0)
    cheap = fused_choice.Chooser(repeats=3, budget_s=1e9)
    cheap.pick("op", ("k",), "x", {"megatron": candidate("megatron"), "torch": candidate("torch")}, (x,))
    assert calls["megatron"] >= 4 and calls["torch"] >= 4  # warm-up + >= 3 timed rounds


def test_grouped_mm_rows_around_a_power_of_two_share_one_choice(chooser):
    """The rows an EP all-to-all delivers wobble around their mean (4096 +- a few dozen here):
    one key, one trial, not a second one in a later (timed) step for 4097 rows."""
    if grouped_gemm.backend_for(torch.empty(0)) != "torch":
        pytest.skip("torch grouped mm does not run here: only the loop exists")
    chooser.trial = FakeTimes(megatron=1.0, torch=2.0)
    w = torch.randn(2, 8, 4, requires_grad=True)
    for rows in (4090, 4096, 4110):
        grouped_gemm.grouped_mm(torch.randn(rows, 8, requires_grad=True), w, [rows // 2, rows - rows // 2])
    assert len(fused_choice.choices()) == 1
    assert [grouped_gemm.row_bucket(n) for n in (2897, 4096, 5792, 5793)] == [4096, 4096, 4096, 8192]


def test_grouped_mm_choice_is_per_shape_recorded_and_runs(chooser):
    """Two weight shapes, two trials: where Megatron's per-expert GEMMs (`linear`) measured
    faster they run, where the fp32 loop did it runs; each decision is a record of the fused-op
    chooser in `npuspeed report`'s path_choices, and the counters show the chosen backend ran.
    (Checked to fail with the comparison in criteria.Fastest flipped to max.)"""
    from npuspeed import reporting

    shapes = {16: dict(megatron=1.0, torch=3.0, loop_fp32=2.0),  # K 16: Megatron's GEMMs win
              24: dict(megatron=3.0, torch=4.0, loop_fp32=1.0)}  # K 24: the fp32 loop wins
    gen = torch.Generator().manual_seed(4)
    ran = {}
    for k, times in shapes.items():
        chooser.trial = FakeTimes(**times)
        x = torch.randn(12, k, generator=gen).to(torch.bfloat16).requires_grad_()
        w = torch.randn(3, k, 8, generator=gen).to(torch.bfloat16).requires_grad_()
        telemetry.reset("moe.grouped_gemm.")
        trials = []
        for _ in range(2):  # the second call takes the recorded choice: no new trial
            grouped_gemm.grouped_mm(x, w, [5, 0, 7]).float().sum().backward()
            trials.append(len(chooser.trial.calls))
        assert trials[0] > 0 and trials[1] == trials[0] and set(chooser.trial.calls) == set(times)
        ran[k] = _grouped_counts()
    assert ran == {16: {"linear": 2}, 24: {"loop_fp32": 2}}
    records = [c for c in reporting._path_choices() if c["op"] == "grouped_mm" and c["chooser"] == "fused ops"]
    want = {"3 experts, ~16x16x8 bf16 cpu": "megatron", "3 experts, ~16x24x8 bf16 cpu": "loop_fp32"}
    got = {r["shape"]: r["impl"] for r in records}  # other tests' shapes may still be recorded beside
    assert {shape: got.get(shape) for shape in want} == want, got
