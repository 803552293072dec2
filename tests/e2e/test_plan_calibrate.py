"""`npuspeed plan --calibrate` end to end on a tiny model: the spawned calibration world times
Megatron's real modules and writes a profile, and the planner prices a step from it (nothing
here asserts a time: only that the profile is complete and used)."""
from __future__ import annotations

import json

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
