"""`npuspeed plan` without running anything: feature effects, layouts, schedule, output shape."""
from __future__ import annotations

import json

import pytest

from npuspeed.features import all_features
from npuspeed.features.base import Feature, PlanEffect
from npuspeed.plan import cli, effects, graph, schedule
from npuspeed.plan.flags import PlanInputError, parse
from npuspeed.plan.planner import plan

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
         "--micro-batch-size", "2"]


def test_every_feature_says_its_plan_module_or_none():
    """A feature's effect is its plan module's effect(model, config); one that changes nothing the
    planner models says plan = None (the full check of the wiring: test_feature_wiring.py)."""
    from npuspeed.features.base import NOT_SAID

    for feature in all_features():
        assert feature.plan is not NOT_SAID, f"{feature.name}: give its class plan = <its plan module> or None"
        assert type(feature).plan_effect is Feature.plan_effect, f"{feature.name} overrides plan_effect"


def test_an_enabled_feature_without_an_effect_is_refused():
    class Silent(Feature):
        name = "silent"

        def enabled(self, args):
            return True

    p = plan(MODEL + ["--nproc-per-node", "1"], with_removes=False)
    with pytest.raises(effects.PlanEffectError, match="silent.*plan = <its plan module>"):
        effects.collect(p.spec, _ctx(), [Silent()])


def _ctx():
    from npuspeed.plan.context import context_for

    return context_for(MODEL)[0]


def test_an_effect_naming_an_unknown_slot_is_refused():
    with pytest.raises(effects.PlanEffectError, match="not a variant"):
        effects.check("x", PlanEffect(variants={"core_attention": "magic"}))
    with pytest.raises(effects.PlanEffectError, match="calibrates"):
        effects.check("x", PlanEffect(kernels={"attention": "magic"}))


def test_the_plan_effect_vocabulary_is_one_module_that_imports_nothing_from_npuspeed():
    import ast
    import pathlib

    import npuspeed
    from npuspeed import plan_vocabulary

    root = pathlib.Path(npuspeed.__file__).parent
    tree = ast.parse(pathlib.Path(plan_vocabulary.__file__).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.split(".")[0] == "npuspeed"]
    assert PlanEffect is plan_vocabulary.PlanEffect and effects.Effects.__mro__[1] is PlanEffect
    words = ("VARIANTS", "SWAP_PARTS", "OPTIONS", "KERNELS")  # declared there and nowhere else
    for path in [*root.rglob("*.py")]:
        if path.name != "plan_vocabulary.py":
            text = path.read_text()
            assert not [w for w in words if f"\n{w} = " in text], path


def test_memory_features_lower_the_predicted_peak():
    base = plan(MODEL + ["--nproc-per-node", "1", "--attention-dropout", "0"], with_removes=False).peak
    for flags in (["--use-flash-attn"], ["--recompute-activation-function"],
                  ["--recompute-granularity", "full"], ["--recompute-granularity", "selective"]):
        assert plan(MODEL + ["--nproc-per-node", "1", "--attention-dropout", "0"] + flags,
                    with_removes=False).peak < base, flags
    bf16 = plan(MODEL + ["--bf16"], with_removes=False)
    reuse = plan(MODEL + ["--bf16", "--reuse-fp32-param"], with_removes=False)
    assert reuse.ranks[0].masters == bf16.ranks[0].masters // 2
    assert reuse.removes["reuse_fp32_param"] > 0 if reuse.removes else True


def test_removes_is_the_peak_difference_without_the_feature():
    p = plan(MODEL + ["--use-flash-attn", "--attention-dropout", "0"])
    without = plan(MODEL + ["--attention-dropout", "0"], with_removes=False)
    assert p.removes["fused_attention"] == without.peak - p.peak > 0


def test_distributed_optimizer_shards_masters_and_states():
    one = plan(MODEL + ["--bf16", "--nproc-per-node", "2"], with_removes=False).ranks[0]
    dist = plan(MODEL + ["--bf16", "--nproc-per-node", "2", "--use-distributed-optimizer"], with_removes=False).ranks[0]
    assert dist.optimizer < one.optimizer * 0.51 and dist.masters < one.masters * 0.51
    assert dist.grads >= one.grads  # the buffer is padded, never smaller


@pytest.mark.parametrize("pp,m,expected", [(2, 4, [2, 1]), (4, 8, [4, 3, 2, 1]), (4, 2, [2, 2, 2, 1])])
def test_1f1b_holds_min_of_stages_left_and_microbatches(pp, m, expected):
    assert [schedule.max_in_flight(pp, r, 1, m) for r in range(pp)] == expected


def test_interleaved_schedule_warmup_matches_megatron():
    # PP2, 2 chunks, 4 micro-batches: rank 0 warms up (2-0-1)*2 + (2-1)*2 = 4 forwards
    ev = schedule.events(2, 0, 2, 4)
    assert ev[:4] == [("F", 0), ("F", 0), ("F", 1), ("F", 1)] and ev[4] == ("F", 0)
    assert sum(1 for k, _ in ev if k == "F") == sum(1 for k, _ in ev if k == "B") == 8
    assert schedule.max_in_flight(2, 1, 2, 4) == 3


def test_replay_counts_a_storage_saved_twice_once_and_frees_it_in_backward():
    g = graph.Graph()
    g.add(graph.Op("a", (), {"x": 100}))
    g.add(graph.Op("b", ("x",), {"y": 10}, saves=("x",)))
    g.add(graph.Op("c", ("y",), {"z": 10}, saves=("x", "y")))
    r = graph.replay(g)
    assert r.held == 110  # x once, y; z (the output) goes to the schedule
    assert r.bwd_peak >= 10  # gradients of y then x appear while x is still held


BAD = [
    (["--tensor-model-parallel-size", "3", "--nproc-per-node", "3"],
     "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
    (["--hidden-size", "250"], "not divisible by --num-attention-heads"),
    (["--pipeline-model-parallel-size", "3", "--nproc-per-node", "3"], "--num-layers 4 is not divisible"),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--nproc-per-node", "2"],
     "not divisible by TP x PP x CP"),
    (["--tensor-model-parallel-size", "8", "--nproc-per-node", "2"], "needs 2 ranks|world size 2"),
    (["--sequence-parallel", "--nproc-per-node", "1"], "needs --tensor-model-parallel-size > 1"),
    (["--global-batch-size", "3", "--nproc-per-node", "2"], "not a multiple of --micro-batch-size"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3",
      "--nproc-per-node", "2"], "does not divide"),
    (["--seq-length", "255", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--nproc-per-node", "2"],
     "--seq-length 255 is not divisible"),
    (["--expert-model-parallel-size", "2", "--nproc-per-node", "2"], "without --num-experts"),
    (["--reuse-fp32-param", "--fp16"], "--reuse-fp32-param works with --bf16 only"),
    (["--use-coc", "--coc-parallel-num", "1"], "--coc-parallel-num N with N > 1"),
]


@pytest.mark.parametrize("flags,reason", BAD)
def test_impossible_layouts_are_listed_with_their_reason(flags, reason, capsys):
    import re

    p = plan(MODEL + flags, with_removes=False)
    assert not p.ok and any(re.search(reason, r) for r in p.problems), p.problems
    assert cli.main(MODEL + flags + ["--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["peak_mem_bytes"] is None and out["problems"] == p.problems


def test_more_ranks_than_devices_and_too_many_pipeline_stages_are_reasons_not_crashes():
    p = plan(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
              "--pipeline-model-parallel-size", "4", "--nproc-per-node", "2"], with_removes=False)
    assert any("--num-layers 2 is not divisible" in r for r in p.problems)
    assert any("world size 2" in r for r in p.problems)


@pytest.mark.parametrize("argv,match", [
    (["--hidden-size", "64"], "needs --num-layers"),
    (MODEL + ["--bf16", "--fp16"], "exclusive"),
    (MODEL + ["--tokenizer-type", "NullTokenizer"], "needs --vocab-size"),
    (MODEL + ["--script", "/nonexistent/launch.sh"], "--script"),
])
def test_unusable_flags_are_one_error_line(argv, match, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("npuspeed plan: error:") and match in err, err
    with pytest.raises(PlanInputError):
        parse(argv) if "--script" not in argv else plan(argv)


def test_json_has_the_contract_keys(capsys):
    assert cli.main(MODEL + ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--json",
                             "--device-memory-gb", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peak_mem_bytes"] > 0 and out["step_ms"] is None and out["fits"] is True
    stage = out["breakdown"]["per_pipeline_stage"][0]
    for key in ("params", "grads", "masters", "optimizer", "activation_per_layer", "activation_per_microbatch",
                "in_flight", "step_peak", "peak"):
        assert key in stage
    assert out["breakdown"]["comm_bytes_per_step"]["tp"] > 0


def test_launch_script_arguments(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("""#!/bin/bash
GPUS_PER_NODE=2
DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE   # ranks
    --nnodes 1
)
MODEL_ARGS=(
    --num-layers 4 --hidden-size 256 \\
    --num-attention-heads 4 --seq-length 256
)
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${MODEL_ARGS[@]} --tensor-model-parallel-size 2 --bf16
""")
    p = plan(["--script", str(script)], with_removes=False)
    assert p.ok and p.spec.layout.tp == 2 and p.spec.devices == 2 and p.spec.batch.dtype == "bf16"
    assert plan(["--script", str(script), "--tensor-model-parallel-size", "1"],
                with_removes=False).spec.layout.tp == 1  # flags given after the script win


def test_search_ranks_only_what_fits_and_prints_runnable_flags(capsys):
    tight = 60  # MiB: several layouts of this model do not fit
    rc = cli.main(MODEL + ["--nproc-per-node", "2", "--bf16", "--search", "--json", "--top", "3",
                           "--device-memory-gb", str(tight / 1024)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["top"], out
    for cand in out["top"]:
        assert cand["peak_mem_bytes"] <= tight * 2**20
        spec, _, _ = parse(cand["flags"].split() + ["--nproc-per-node", "2"])
        assert plan(cand["flags"].split() + ["--nproc-per-node", "2"], with_removes=False).ok
    assert any("does not fit" in r["reason"] for r in out["rejected"])


def test_cpu_memory_limit_refuses_allocations_above_it(monkeypatch):
    import torch

    from npuspeed.accelerator.base import AcceleratorError
    from npuspeed.accelerator.cpu import LIMIT_ENV, CpuAccelerator
    from npuspeed.ops import memory_tracker

    acc = CpuAccelerator()
    acc.enable_memory_tracking()
    monkeypatch.setenv(LIMIT_ENV, "lots")
    with pytest.raises(AcceleratorError, match=LIMIT_ENV):
        acc.configure_memory_limit()
    try:
        monkeypatch.setenv(LIMIT_ENV, str((memory_tracker.allocated() + (8 << 20)) / 2**20))
        assert "MiB of live tensors" in acc.configure_memory_limit()
        small = torch.empty(1 << 20, dtype=torch.uint8)  # 1 MiB: under the limit
        with pytest.raises(torch.OutOfMemoryError, match="npuspeed CPU memory limit"):
            torch.empty(16 << 20, dtype=torch.uint8)
        del small
    finally:
        monkeypatch.setenv(LIMIT_ENV, "0")
        assert acc.configure_memory_limit() == "none" and memory_tracker.limit() == 0
