"""`npuspeed report`: the JSON contract (keys only ever added) and the human table."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tiers import pinned

NPUSPEED = os.path.join(os.path.dirname(sys.executable), "npuspeed")


@pytest.fixture(scope="module")
def report_json():
    cmd = [NPUSPEED] if os.path.exists(NPUSPEED) else [sys.executable, "-m", "npuspeed.cli"]
    env = pinned({k: v for k, v in os.environ.items() if k != "NPUSPEED_ARGS"})  # the CPU tier's backend
    proc = subprocess.run(cmd + ["report", "--json"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_report_json_contract(report_json):
    data = report_json
    import torch

    from npuspeed.patching.versions import megatron_version

    for key in ("device", "dist_backend", "torch_version", "megatron_core_version", "features",
                "patches", "ops", "notes", "npuspeed_version", "accelerator", "a2a_hidden_fraction",
                "swap_sizing", "host_link"):
        assert key in data, key
    assert data["a2a_hidden_fraction"] is None  # no expert all-to-all ran in `npuspeed report`
    assert data["swap_sizing"] == [] and data["host_link"] == {}  # no swap sized or measured a link
    assert data["torch_version"] == torch.__version__
    assert data["megatron_core_version"] == str(megatron_version())
    assert (data["device"], data["dist_backend"]) == ("cpu", "gloo")
    for feature in data["features"]:
        assert {"name", "enabled", "path"} <= set(feature)
    device = next(f for f in data["features"] if f["name"] == "device")
    assert device["enabled"] is True and device["path"].startswith("cpu:")
    for patch in data["patches"]:
        assert {"target", "feature", "kind", "status"} <= set(patch)
        assert patch["status"] in ("applied", "skipped")
        assert patch["status"] == "applied" or patch["reason"]
    for op in data["ops"]:
        assert {"name", "compiled", "implementation"} <= set(op)
    assert any(op["name"] == "memory_tracker" for op in data["ops"])


def test_report_lists_device_patches(report_json):
    rows = {(p["target"], p["feature"]): p for p in report_json["patches"]}
    for target in ("torch.cuda.current_device", "torch.cuda.manual_seed",
                   "torch.distributed.init_process_group",
                   "megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork"):
        assert rows[(target, "device")]["status"] == "applied", target
    assert rows[("torch.cuda.current_device", "device")]["kind"] == "replace"
    assert rows[("torch.distributed.init_process_group", "device")]["kind"] == "wrap"


def test_human_table_renders(report_json, npuspeed_runtime, capsys):
    from npuspeed import cli, report
    from npuspeed.reporting import render

    text = render(report_json, patches=True)
    lines = text.splitlines()
    assert lines[0].startswith("npuspeed ")
    assert any(line.split()[:2] == ["device", "on"] for line in lines)
    assert any(line.startswith("torch.cuda.current_device") and "applied" in line for line in lines)
    for header in ("feature", "op", "patch target"):
        assert any(line.startswith(header) for line in lines), header
    # by default the ~80 patch targets are one line counting them (`--patches` lists them)
    short = render(report_json)
    assert "patch target" not in short and "torch.cuda.current_device" not in short
    applied = sum(p["status"] == "applied" for p in report_json["patches"])
    assert f"patches: {applied} applied (" in short and "npuspeed report --patches" in short
    # the in-process CLI and API give the same kind of table
    assert cli.main(["report", "--patches"]) == 0
    out = capsys.readouterr().out
    assert "patch target" in out and "torch.cuda.current_device" in out
    assert cli.main(["report"]) == 0
    assert "patch target" not in capsys.readouterr().out
    assert report(as_json=True)["device"] == "cpu"
    assert "dist backend: gloo" in report()


def test_the_report_function_survives_its_module_import():
    """`npuspeed.report()` is public API; the module behind it must not shadow the name."""
    import npuspeed
    import npuspeed.reporting  # noqa: F401

    assert callable(npuspeed.report) and "device" in npuspeed.report(as_json=True)
