"""--schedules-method dualpipev (megatron-core 0.14+) against Megatron's interleaved schedule at
the same layout: 4 ranks (PP2 x DP2, EP2 inside DP), 4 layers, 4 experts top-2, fp32, dropout
off, untied embeddings, 4 micro-batches a step, 8 iterations. The two place the layers
differently (DualPipeV's V: pipeline rank 0 holds layers 1 and 4, rank 1 layers 2 and 3;
Megatron's interleaving: 1 and 3, 2 and 4), so gradients are compared by their global names
(the example initialises every layout's weights from the global names). Losses and every
step's gradients within 1e-6, alone and with --moe-fb-overlap's turns; counters prove the V
order ran (its paired steps per rank) and the overlap's pairs took turns. Checkpoints resume
across the flag both ways; bf16 within its tolerance. CI runs the overlap case (it runs the whole
V order); `make bench` (-m slow) the rest.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import NO_DROPOUT

from npuspeed.patching.versions import in_range

RUNNER = Path(__file__).resolve().parent / "_example_with_step_grads.py"
TOL = 1e-6
ITERS = 8
NPROC = 4
MICRO = 4
MODEL = ["--use-cpu-initialization", "--make-vocab-size-divisible-by", "1", "--log-interval", "1",
         *NO_DROPOUT, "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear",
         "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--num-layers-per-virtual-pipeline-stage", "1", "--untie-embeddings-and-output-weights",
         "--global-batch-size", "8", "--micro-batch-size", "1", "--train-iters", str(ITERS)]
DUALPIPEV = ["--schedules-method", "dualpipev"]
_RUNS: dict = {}

pytestmark = pytest.mark.skipif(not in_range(">=0.14,<0.20"), reason="DualPipeV's V needs megatron-core 0.14+")


def paired_per_step(pp: int, rank: int, m: int) -> int:
    """DualPipeV's paired steps on pipeline rank `rank` (pipeline/v_order.py): 2 per steady repeat, 1 per
    cool-down repeat of backward-then-pair."""
    return 2 * (m - 2 * pp + rank + 1) + (pp - rank - 1)


SAVE_AT = 4
# the paired path, and the bubble measured as the bench measures it (steps started together)
FB_ENV = {"NPUSPEED_FB_OVERLAP_PATH": "paired", "NPUSPEED_MEASURE_BUBBLE": "1"}
SAVES = ("base", "fb")  # these two save at SAVE_AT too: the sources of the resume test


def _run(tmp_path_factory, name: str, args: list[str], env: dict | None = None) -> dict:
    if name in _RUNS:
        return _RUNS[name]
    from launch import run_example

    tmp = tmp_path_factory.mktemp(name)
    out = tmp / "dump"
    save = ["--save", str(tmp / "ckpt"), "--save-interval", str(SAVE_AT)] if name in SAVES else []
    run = run_example(MODEL + args + save + ["--step-grads-out", str(out)], tmp, nproc=NPROC, name=name, env=env,
                      script=RUNNER, timeout=900)
    run["dumps"] = [torch.load(f"{out}.rank{r}") for r in range(NPROC)]
    run["ckpt"] = str(tmp / "ckpt") if save else None
    _RUNS[name] = run
    return run


def global_grads(run) -> list[dict]:
    """Per step {global name: gradient}, over all ranks (data-parallel copies agree)."""
    steps = [{} for _ in range(ITERS)]
    for dump in run["dumps"]:
        names = dump["global_names"]
        for step, grads in zip(steps, dump["grads"]):
            for key, grad in grads.items():
                step.setdefault(names[key], grad)
    return steps


def gaps(a: dict, b: dict) -> tuple[float, float]:
    loss = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    grad = 0.0
    for ga, gb in zip(global_grads(a), global_grads(b)):
        assert ga.keys() == gb.keys(), sorted(set(ga) ^ set(gb))[:8]
        for name in ga:
            scale = max(float(gb[name].abs().max()), 1.0)
            grad = max(grad, float((ga[name] - gb[name]).abs().max()) / scale)
    return loss, grad


def layers_by_rank(run) -> list[list[int]]:
    """Each rank's global layer numbers (1-based), chunk 0's then chunk 1's."""
    out = []
    for dump in run["dumps"]:
        layers = []
        for chunk in ("0", "1"):
            numbers = {int(n.split("decoder.layers.")[1].split(".")[0]) + 1
                       for k, n in dump["global_names"].items() if k.startswith(chunk + ".") and "decoder.layers." in n}
            layers += sorted(numbers)
        out.append(layers)
    return out


@pytest.mark.parametrize("overlap", [pytest.param(False, marks=pytest.mark.slow), True], ids=["alone", "moe-fb-overlap"])
def test_dualpipev_matches_interleaved(tmp_path_factory, overlap):
    base = _run(tmp_path_factory, "base", [])
    args = DUALPIPEV + (["--moe-fb-overlap"] if overlap else [])
    env = FB_ENV if overlap else None
    run = _run(tmp_path_factory, "fb" if overlap else "alone", args, env)
    loss, grad = gaps(run, base)
    print(f"dualpipev{' + overlap' if overlap else ''}: max loss gap {loss:.3g}, max grad gap {grad:.3g}")
    assert loss <= TOL and grad <= TOL, (loss, grad, run["losses"], base["losses"])
    if not overlap:  # the pairs taking turns change when each half runs, not what it computes: bitwise
        fb = _run(tmp_path_factory, "fb", DUALPIPEV + ["--moe-fb-overlap"], FB_ENV)
        assert gaps(run, fb) == (0.0, 0.0) and run["losses"] == fb["losses"]
    # the V: pipeline rank 0 (global ranks 0, 1) holds layers 1 and 4, rank 1 (2, 3) layers 2 and 3
    assert layers_by_rank(run) == [[1, 4], [1, 4], [2, 3], [2, 3]]
    assert layers_by_rank(base) == [[1, 3], [1, 3], [2, 4], [2, 4]]
    for rank, dump in enumerate(run["dumps"]):
        c, pp_rank = dump["counters"], rank // 2
        assert c.get("dualpipev.steps") == ITERS, c
        assert c.get("dualpipev.paired_ops") == ITERS * paired_per_step(2, pp_rank, MICRO), c
        assert c.get("moe.fb_overlap.pairs", 0) == (c["dualpipev.paired_ops"] if overlap else 0), c
        if overlap:
            assert c.get("moe.fb_overlap.turn.forward", 0) > 0 and c.get("moe.fb_overlap.turn.backward", 0) > 0, c
            assert c.get("moe.fb_overlap.a2a.forward.overlapped", 0) > 0, c
    assert not any(k.startswith("dualpipev") for d in base["dumps"] for k in d["counters"])
    # evaluation (forward only, as Megatron-LM calls it): the same losses, on the loss's rank (the
    # V's rank 0, global ranks 0-1; the interleaved schedule's last, 2-3)
    evals = [d["eval"] for d in run["dumps"]]
    assert [bool(e) for e in evals] == [True, True, False, False], evals
    assert [bool(d["eval"]) for d in base["dumps"]] == [False, False, True, True]
    gap = max(abs(x - y) for x, y in zip(evals[0] + evals[1], base["dumps"][2]["eval"] + base["dumps"][3]["eval"]))
    assert len(evals[0]) == MICRO and gap <= TOL, (evals, [d["eval"] for d in base["dumps"]])
    bubbles = run["pipeline_bubble"]
    assert [b["rank"] for b in bubbles] == list(range(NPROC))
    for b in bubbles:
        assert b["steps"] == ITERS - 1 and b["waits"] > 0 and b["idle_ms_per_step"] > 0, b
        if overlap:  # NPUSPEED_MEASURE_BUBBLE=1: transfers out, the wait for the pipeline's end in
            assert b["hop_ms"] > 0 and 0 <= b["transfer_ms_per_step"] <= b["idle_ms_per_step"], b
            assert b["tail_ms_per_step"] >= 0 and b["imbalance_ms_per_step"] >= 0, b
            assert b["bubble_ms_per_step"] > 0 and b["bubble_over_formula"] > 0, b
    if overlap:  # each step, some rank of a pipeline ends last and waits for none: a small tail on one
        for pipeline in ((0, 2), (1, 3)):
            assert min(bubbles[r]["tail_ms_per_step"] for r in pipeline) < max(bubbles[r]["tail_ms_per_step"]
                                                                             for r in pipeline), bubbles


@pytest.mark.slow  # CI time: `make bench` runs it (megatron-core 0.14.0, 0.15.0, 0.16.1, 0.19.2 checked)
@pytest.mark.parametrize("direction", ["dualpipev-to-interleaved", "interleaved-to-dualpipev"])
def test_checkpoints_resume_across_the_flag(tmp_path_factory, direction):
    """A DualPipeV checkpoint holds Megatron's keys (global layer numbers): Megatron's interleaved
    schedule resumes from it at iteration 5, and DualPipeV from the interleaved schedule's, each
    continuing the uninterrupted run's losses."""
    from launch import run_example

    base = _run(tmp_path_factory, "base", [])
    fb = _run(tmp_path_factory, "fb", DUALPIPEV + ["--moe-fb-overlap"], FB_ENV)
    src, args = (fb, []) if direction == "dualpipev-to-interleaved" else (base, DUALPIPEV + ["--moe-fb-overlap"])
    tmp = tmp_path_factory.mktemp(direction)
    resumed = run_example(MODEL + args + ["--load", src["ckpt"], "--ckpt-step", str(SAVE_AT)], tmp, nproc=NPROC,
                          name=direction, env={"NPUSPEED_FB_OVERLAP_PATH": "paired"}, timeout=900)
    assert resumed["first_iteration"] == SAVE_AT + 1
    gap = max(abs(x - y) for x, y in zip(resumed["losses"], base["losses"][SAVE_AT:]))
    print(f"{direction}: losses {resumed['losses']}, max gap to the uninterrupted run {gap:.3g}")
    assert len(resumed["losses"]) == ITERS - SAVE_AT and gap <= TOL, (resumed["losses"], base["losses"])


@pytest.mark.slow  # CI time: `make bench` runs it
def test_bf16_matches_interleaved(tmp_path_factory):
    """bf16 (Megatron's Float16Module: its fp32 output belongs to the chunk that computes the
    loss, rank 0's chunk 1 under the V): losses within bf16's tolerance of the interleaved run."""
    base = _run(tmp_path_factory, "base-bf16", ["--bf16"])
    run = _run(tmp_path_factory, "fb-bf16", DUALPIPEV + ["--moe-fb-overlap", "--bf16"],
               {"NPUSPEED_FB_OVERLAP_PATH": "paired"})
    gap = max(abs(x - y) for x, y in zip(run["losses"], base["losses"]))
    print(f"bf16: max loss gap {gap:.3g}")
    assert gap <= 2e-2, (run["losses"], base["losses"])
    assert all(d["counters"].get("moe.fb_overlap.pairs", 0) > 0 for d in run["dumps"])


DENSE = ["--use-cpu-initialization", "--make-vocab-size-divisible-by", "1", "--log-interval", "1", *NO_DROPOUT,
         "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--num-layers-per-virtual-pipeline-stage", "1", "--untie-embeddings-and-output-weights",
         "--micro-batch-size", "1", "--train-iters", "4"]
PP2 = ["--pipeline-model-parallel-size", "2", "--num-layers", "4"]


@pytest.mark.slow  # CI time: `make bench` runs it
@pytest.mark.parametrize("layout", [
    PP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "4"],
    PP2 + ["--overlap-grad-reduce", "--use-distributed-optimizer", "--global-batch-size", "8"],
    ["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--global-batch-size", "8"]],
    ids=["tp2-sp", "dp2-overlap-grad-reduce", "pp4"])
def test_dense_layouts_match_interleaved(tmp_path_factory, layout):
    """DualPipeV with tensor parallelism and sequence parallelism (activations of S/TP rows travel),
    with DP 2's gradient reduction overlapped (no_sync until each chunk's last backward, the
    distributed optimizer), and at PP 4 (middle ranks that receive and send both ways, rank 3's
    hand-over inside the rank): the interleaved schedule's losses."""
    from launch import run_example

    tmp = tmp_path_factory.mktemp("dense")
    base = run_example(DENSE + layout, tmp, nproc=NPROC, name="base", timeout=900)
    run = run_example(DENSE + layout + DUALPIPEV, tmp, nproc=NPROC, name="dualpipev", timeout=900)
    gap = max(abs(x - y) for x, y in zip(run["losses"], base["losses"]))
    print(f"{' '.join(layout[:4])}: losses {run['losses']}, max gap {gap:.3g}")
    assert len(run["losses"]) == 4 and gap <= TOL, (run["losses"], base["losses"])
