"""`npuspeed plan --calibrate` end to end on a tiny model: the spawned calibration world times
Megatron's real modules and writes a profile, and the planner prices a step from it (nothing
here asserts a time: only that the profile is complete and used)."""
from __future__ import annotations

import json

import pytest

from npuspeed.plan import cli
from npuspeed.plan.speed import group_key, load_profile

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "64",
        "--micro-batch-size", "1", "--global-batch-size", "2", "--max-position-embeddings", "64",
        "--nproc-per-node", "1"]


def test_calibrate_writes_a_profile_the_plan_prices_a_step_from(tmp_path, capsys):
    path = tmp_path / "profile.json"
    assert cli.main(TINY + ["--calibrate", "--profile", str(path)]) == 0
    profile = load_profile(str(path))
    group = profile["groups"][group_key(1, False)]
    for part in ("layer", "pre", "full"):  # forward and backward at two token counts, all measured
        assert len(group[part]) == 2 and all(t > 0 for row in group[part] for t in row)
    assert profile["optimizer"]["plain"]["points"]
    capsys.readouterr()
    assert cli.main(TINY + ["--profile", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_ms"] > 0 and out["tokens_per_s"] > 0
    assert out["breakdown"]["speed"]["group"] == group_key(1, False)


# `make bench` (-m slow): two calibration worlds (~25 s); CI calibrates a plain run above and
# tests/unit/test_plan_speed.py checks the CP group shapes the calibration times
@pytest.mark.slow
def test_calibrate_a_context_parallel_run_times_its_cp_group_and_the_search_s_others(tmp_path, capsys):
    """CP ranks run under the CP feature's patches, which refuse a model without CP: the CP-1
    shapes --search prices are timed in a second world without the CP flags."""
    path = tmp_path / "profile.json"
    cp = ["--nproc-per-node", "2", "--use-flash-attn", "--context-parallel-size", "2"]
    assert cli.main(TINY[:-2] + cp + ["--calibrate", "--profile", str(path)]) == 0
    profile = load_profile(str(path))
    assert {group_key(1, False, 2), group_key(1, False), group_key(2, False)} <= set(profile["groups"])
    capsys.readouterr()
    assert cli.main(TINY[:-2] + cp + ["--profile", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_ms"] > 0 and out["breakdown"]["speed"]["group"] == group_key(1, False, 2)


def test_without_cp_drops_the_cp_flags_and_their_values():
    from npuspeed.plan.calibrate import without_cp

    argv = ["--a", "1", "--context-parallel-size", "2", "--context-parallel-algo=ulysses_cp_algo",
            "--ulysses-degree-in-cp", "2", "--b"]
    assert without_cp(argv) == ["--a", "1", "--b"]
