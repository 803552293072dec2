"""The example's MoE model with npuspeed's MoE flags against the same model without them.

fp32, dropout off, 8 iterations: every loss within 1e-5 of the run without the flags at the
same layout (and of the 1-rank run where routing does not depend on the layout, i.e.
without a capacity factor); the expert-weight gradients of the first step within 1e-5
weight by weight (GroupedMLP's mapped onto SequentialMLP's); counters prove the grouped
GEMM, the fused permute and the chunked all-to-all ran, and that the baseline ran none.
CI runs a few representative cases; `-m slow` runs the whole matrix (layouts EP1, EP2,
EP2 x TP2 with and without --moe-tp-extend-ep; top-1/top-2; 4/8 experts; capacity factor;
shared experts).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from launch import NO_DROPOUT, TINY, free_port, max_abs_diff

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNNER = os.path.join(ROOT, "tests", "distributed", "_moe_runner.py")
TOL = 1e-5
FLAGS = ["--moe-grouped-gemm", "--use-fused-moe-token-permute-and-unpermute"]
OVERLAP = ["--moe-alltoall-overlap-comm"]
EP2TP2 = ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
#: layout -> (Megatron's layout flags, ranks, npuspeed layout flags of the flagged run)
LAYOUTS = {
    "ep1": ([], 1, []),
    "ep2": (["--expert-model-parallel-size", "2"], 2, []),
    "ep2tp2": (EP2TP2, 4, []),
    "ep2tp2-ext": (EP2TP2, 4, ["--moe-tp-extend-ep"]),
}


@pytest.fixture(scope="module", autouse=True)
def _force_npuspeed_kernels():
    """These runs test npuspeed's kernels (their counters are asserted): force them instead of the
    per-shape measurement, which may pick Megatron's path on a tiny model (tests/unit/test_*choice*)."""
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setenv("NPUSPEED_FUSED_OP_PATH", "npuspeed")
        yield


def model(topk: int, experts: int, capacity: bool = False, shared: bool = False, swiglu: bool = False) -> list[str]:
    args = ["--num-experts", str(experts), "--moe-router-topk", str(topk), "--disable-bias-linear",
            "--train-iters", "8"] + (["--swiglu"] if swiglu else [])
    if topk == 1:
        args += ["--moe-router-pre-softmax"]  # Megatron requires it for top-1
    if capacity:
        args += ["--moe-expert-capacity-factor", "1.0"]
    if shared:
        args += ["--moe-shared-expert-intermediate-size", "96"]
    return args


_RUNS: dict = {}


def train(tmp_path_factory, args: list[str], nproc: int) -> dict:
    """Summary, per-rank dumps and log of one run (cached per argument list in this module)."""
    key = (tuple(args), nproc)
    if key in _RUNS:
        return _RUNS[key]
    out = tmp_path_factory.mktemp("moe")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), RUNNER, *TINY, *NO_DROPOUT, *args,
           "--summary-json", str(out / "summary.json"), "--moe-dump", str(out / "dump")]
    env = {k: v for k, v in os.environ.items() if k != "NPUSPEED_ARGS"}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"run failed: {' '.join(cmd)}\n{log[-5000:]}"
    dumps = [torch.load(out / f"dump.rank{r}", weights_only=False) for r in range(nproc)]
    _RUNS[key] = {"losses": json.loads((out / "summary.json").read_text())["losses"], "dumps": dumps, "log": log}
    return _RUNS[key]


def grads_by_weight(run) -> dict:
    """Global weight name -> gradient, expert-TP shards concatenated (rows of fc1 per half)."""
    shards: dict = {}
    for dump in run["dumps"]:
        for name, (etp_rank, grad) in dump["grads"].items():
            shards.setdefault(name, {})[etp_rank] = grad
    full = {}
    for name, parts in shards.items():
        pieces = [parts[r] for r in sorted(parts)]
        if len(pieces) == 1:
            full[name] = pieces[0]
        elif name.endswith("linear_fc2.weight"):
            full[name] = torch.cat(pieces, dim=1)
        else:  # fc1 of SwiGLU-free experts: rows split; GLU halves would interleave (not used here)
            full[name] = torch.cat(pieces, dim=0)
    return full


def assert_same_grads(a, b) -> None:
    ga, gb = grads_by_weight(a), grads_by_weight(b)
    assert ga.keys() == gb.keys() and ga, (sorted(ga)[:4], sorted(gb)[:4])
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], atol=TOL, rtol=TOL, msg=name)


def counters(run) -> list[dict]:
    return [d["counters"] for d in run["dumps"]]


def check_case(tmp_path_factory, layout: str, moe: list[str], overlap: bool) -> None:
    layout_args, nproc, layout_flags = LAYOUTS[layout]
    base = train(tmp_path_factory, moe + layout_args, nproc)
    flags = FLAGS + layout_flags + (OVERLAP if overlap else [])
    run = train(tmp_path_factory, moe + layout_args + flags, nproc)
    assert len(run["losses"]) == 8 and run["losses"][-1] < run["losses"][0]
    assert max_abs_diff(run["losses"], base["losses"]) <= TOL, (run["losses"], base["losses"])
    assert_same_grads(run, base)
    if "--moe-expert-capacity-factor" not in moe and layout != "ep1":  # routing independent of layout
        single = train(tmp_path_factory, moe, 1)
        assert max_abs_diff(run["losses"], single["losses"]) <= TOL
        if "--tensor-model-parallel-size" not in layout_args or layout_flags:
            assert_same_grads(run, single)
    for c in counters(base):
        assert not any(k.startswith(("moe.grouped_gemm", "moe.a2a", "ops.moe_")) for k in c), c
    for c in counters(run):
        assert c.get("moe.grouped_gemm.torch", 0) > 0, c
        assert c.get("ops.moe_permute.cpp", 0) > 0 and c.get("ops.moe_unpermute.cpp", 0) > 0, c
        assert not any(k.endswith(".reference") and k.startswith("ops.moe") for k in c), c
        if overlap:
            assert c.get("moe.a2a_overlap.dispatch_chunks", 0) > 0 and c.get("moe.a2a.dispatch.backward", 0) > 0, c
            assert c["moe.a2a_overlap.dispatch_chunks"] == c["moe.a2a_overlap.combine_chunks"], c
            assert not c.get("moe.a2a_overlap.fallback"), c
            # the step trial (candidates.py) ran both layers: set-up + 2 rounds of each, then its choice
            assert c.get("moe.a2a_overlap.steps_chunked", 0) >= 3 and c.get("moe.a2a_overlap.steps_megatron", 0) >= 2, c
            if "--moe-shared-expert-intermediate-size" in moe:
                assert c.get("moe.a2a_overlap.shared_experts_overlapped", 0) > 0, c
    if layout_flags:  # --moe-tp-extend-ep: experts over EP x TP = 4 ranks, whole (vs expert-TP 2 without)
        assert all(d["info"]["ep_size"] == 4 and d["info"]["etp_size"] == 1 for d in run["dumps"])
        assert all(d["info"]["ep_size"] == 2 and d["info"]["etp_size"] == 2 for d in base["dumps"])


pytest.importorskip("megatron.core")


# CI runs the EP2 x TP2 case; the EP2 top-2 SwiGLU case runs with `make bench` (-m slow), as
# does the whole matrix below (its top-2 rows included)
@pytest.mark.parametrize("layout,moe,overlap", [
    pytest.param("ep2", model(2, 4, swiglu=True), True, marks=pytest.mark.slow),
    pytest.param("ep2tp2-ext", model(1, 8, capacity=True, shared=True), True,
                 marks=pytest.mark.slow),  # CI time: MoE EP2 parity (test_parallel_parity) and test_moe_pipeline stay
], ids=["ep2-top2-e4-swiglu", "ep2tp2-ext-top1-e8-capacity-shared"])
def test_moe_flags_match_megatron(tmp_path_factory, layout, moe, overlap):
    check_case(tmp_path_factory, layout, moe, overlap)


MATRIX = [(layout, topk, experts, capacity, shared)
          for layout in LAYOUTS for topk, experts, capacity, shared in
          [(2, 4, False, False), (1, 8, False, True), (2, 8, True, False), (1, 4, True, True)]]


@pytest.mark.slow
@pytest.mark.parametrize("layout,topk,experts,capacity,shared", MATRIX,
                         ids=[f"{lay}-top{k}-e{e}{'-cap' if c else ''}{'-shared' if s else ''}"
                              for lay, k, e, c, s in MATRIX])
def test_moe_matrix(tmp_path_factory, layout, topk, experts, capacity, shared):
    overlap = layout in ("ep2", "ep2tp2-ext")  # the chunked all-to-all needs EP > 1 and whole experts
    check_case(tmp_path_factory, layout, model(topk, experts, capacity, shared), overlap)


@pytest.mark.slow
def test_moe_swiglu_experts_split_by_expert_tp(tmp_path_factory):
    """GroupedMLP's SwiGLU fc1 split over expert-TP 2 ([gate_r; up_r] per rank) against SequentialMLP's."""
    check_case(tmp_path_factory, "ep2tp2", model(2, 4, swiglu=True), overlap=False)


@pytest.mark.slow
def test_moe_composes_with_pipeline_and_fused_ops(tmp_path_factory):
    """EP2 x PP2 (4 ranks), Llama-style, every MoE flag together with fused attention, RMSNorm and
    RoPE, against the same layout with no npuspeed flag (1e-4: the fused ops round differently,
    as in their own e2e test). (--use-fused-swiglu would refuse: with grouped GEMM the model has
    no dense SwiGLU MLP left, the experts' SwiGLU is fused by the grouped path itself.)"""
    from launch import LLAMA

    layout = ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4"]
    moe = model(2, 4) + LLAMA
    base = train(tmp_path_factory, moe + layout, 4)
    run = train(tmp_path_factory, moe + layout + FLAGS + OVERLAP + [
        "--use-flash-attn", "--use-fused-rmsnorm", "--use-fused-rotary-pos-emb"], 4)
    assert max_abs_diff(run["losses"], base["losses"]) <= 1e-4
    for c in counters(run):
        assert c.get("moe.grouped_gemm.torch", 0) > 0 and c.get("moe.a2a_overlap.dispatch_chunks", 0) > 0, c
        assert c.get("ops.rms_norm.cpp", 0) > 0 and c.get("ops.moe_permute.cpp", 0) > 0, c
        assert c.get("ops.moe_weighted_swiglu.cpp", 0) > 0, c
