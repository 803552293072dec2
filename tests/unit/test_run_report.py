"""`npuspeed report --run SUMMARY [--baseline SUMMARY]`: a finished run's own report, and its errors."""
from __future__ import annotations

import json

import pytest

from npuspeed import cli, run_report
from npuspeed.errors import UserError


def _summary(tokens_per_s: float, peak: int, on: list[str]) -> dict:
    features = [{"name": n, "enabled": n in on or n == "device", "path": f"{n} path" if n in on else "off",
                 "flags": []} for n in ("device", "fused_rmsnorm", "fused_swiglu")]
    report = {"npuspeed_version": "x", "torch_version": "t", "megatron_core_version": "m", "python_version": "p",
              "device": "cpu", "dist_backend": "gloo",
              "accelerator": {"device_name": "cpu", "memory_tracking": "yes"}, "features": features,
              "ops": [], "patches": [{"target": "a.b", "feature": "device", "kind": "wrap", "status": "applied",
                                      "reason": ""}], "notes": [], "counters": {"ops.rms_norm.cpp": 4}}
    return {"tokens_per_s": tokens_per_s, "median_step_ms": 1000.0, "peak_mem_bytes": peak, "iterations": 3,
            "losses": [5.0, 4.0], "npuspeed_report": report}


def test_comparison_against_the_baseline():
    run, base = _summary(300.0, 2**20, ["fused_rmsnorm"]), _summary(200.0, 4 * 2**20, [])
    cmp = run_report.comparison(run, base)
    assert cmp["tokens_per_s_ratio"] == pytest.approx(1.5) and cmp["peak_mem_ratio"] == pytest.approx(0.25)
    assert cmp["enabled_features"] == ["fused_rmsnorm"] and cmp["baseline"]["enabled_features"] == []
    text = run_report.render(run, base)
    assert "with the flags: 1.50x the tokens/s and 0.25x the peak memory" in text
    assert "[fused_rmsnorm] 300 tokens/s" in text and "[no npuspeed feature] 200 tokens/s" in text
    assert "off: fused_swiglu" in text and "ops.rms_norm.cpp: 4" in text
    assert "patch target" not in text and "patch target" in run_report.render(run, base, patches=True)


def test_bad_summaries_are_one_line(tmp_path, capsys):
    (tmp_path / "junk.json").write_text("{")
    (tmp_path / "other.json").write_text(json.dumps({"losses": [1.0]}))
    for name, words in (("missing.json", "cannot read it"), ("junk.json", "not JSON"),
                        ("other.json", "not a training summary")):
        with pytest.raises(UserError, match=f"--run .*{name}: {words}"):
            run_report.load(str(tmp_path / name), "--run")
    old = _summary(1.0, 1, [])
    del old["npuspeed_report"]
    with pytest.raises(UserError, match="no npuspeed_report"):
        run_report.render(old, None)
    (tmp_path / "run.json").write_text(json.dumps(_summary(1.0, 1, [])))
    with pytest.raises(SystemExit):
        cli.main(["report", "--baseline", str(tmp_path / "run.json")])
    assert "--baseline needs --run" in capsys.readouterr().err
