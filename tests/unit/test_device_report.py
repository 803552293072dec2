"""`make device-report`'s own code on CPU: the Markdown and the docs/accelerators.md section come from the
report's JSON (figures derived, failures listed, date/device/commit in the head), a smoke
report is refused as README figures, and the markers are required. The whole command at a tiny
size on CPU (`--smoke`) is `slow` (about 3 minutes here)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "device_report"))

import readme  # noqa: E402
import render  # noqa: E402


def _run(tokens, step_ms, peak, **extra):
    return {"losses": [5.0, 4.0], "tokens_per_s": tokens, "median_step_ms": step_ms, "peak_mem_bytes": peak,
            "tflops_per_s_per_rank": 300.0, "mfu": 0.3, "weight_bytes": 6 * 10**6, "npuspeed_counters": extra}


def _report(smoke=False) -> dict:
    runs = {"all off": _run(30000, 1000, 26 * 2**30), "flash-attn": _run(90000, 400, 9 * 2**30),
            "all flags": {"error": "example failed (1): boom"},
            "reuse-fp32-param": _run(89000, 404, 8 * 2**30, **{"reuse.codec.split.triton": 8, "other": 1})}
    return {"meta": {"date": "2026-11-26", "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3",
                     "torch": "2.11.0", "triton": "3.6.0", "megatron_core": "0.16.1", "python": "3.12.3",
                     "commit": "abc1234", "smoke": smoke, "budget_s": 480, "wall_s": 470.2},
            "tier": {"counts": {"passed": 20, "failed": 1, "skipped": 1},
                     "cases": [{"test": "t::a", "state": "failed", "message": "loss gap 3e-2"}]},
            "training": {"runs": runs, "base_of": {"reuse-fp32-param": "flash-attn", "swap-attention": "flash-attn"},
                         "e2e": ["all off", "flash-attn", "all flags"],
                         "flags": {"all off": [], "flash-attn": ["--use-flash-attn"], "all flags": []}},
            "codec": {"timings": [{"codec": "triton", "params": 709 * 10**6, "one_buffer": True,
                                   "ms_per_step": 6.0, "gb_per_s": 1700.0}]},
            "fused_ops": {"rows": [{"case": "rms_norm 4096x4096 [chosen]", "dtype": "bf16", "baseline_ms": "0.5",
                                    "feature_ms": "0.25", "speedup": "2.0", "extra": {"chosen": {"impl": "triton"}}}]}}


def test_markdown_derives_the_figures_and_lists_failures():
    report = _report()
    derived = render.derive(report)
    md = render.markdown(report, derived)
    assert "| flash-attn | 90000 | 3.00x | 300.0 | 30.0% | 9.00 |" in md
    assert "| all flags | failed: example failed (1): boom" in md
    assert "| reuse-fp32-param | 404.0 (400.0) | 1.010x | 8.00 (9.00) | reuse.codec.split.triton=8 |" in md
    assert "swap-attention | failed: not run" in md
    assert "FAILED `t::a`: loss gap 3e-2" in md and "20 passed, 1 failed, 1 skipped" in md
    assert "1.5% of the flash-attn step" in md  # 6 ms of a 400 ms step
    assert "| rms_norm 4096x4096 | bf16 | chosen | 0.500 | 0.250 | 2.00x | triton |" in md


def test_the_fused_op_table_shows_each_candidate_and_the_pick_and_triton_failures():
    """The kernel table is the chooser's records (bench_fused_choice.py): every candidate's time,
    its first call apart, the dropped ones with their reason, the pick; a Triton case that failed
    is listed beside the rows that were measured."""
    report = _report()
    report["fused_ops"] = {"table": {
        "model": {"hidden": 2048, "ffn": 5632, "heads": 16, "groups": 4, "seq": 4096, "micro_batch": 1},
        "compile": {"wanted": True, "failure": None}, "megatron_stand_ins": [],
        "choices": [{"op": "swiglu", "shape": "4096x11264 bf16 cuda", "impl": "compile", "baseline": "megatron",
                     "why": "...", "ms": {"megatron": 0.4, "triton": 0.35, "compile": 0.3},
                     "first_ms": {"megatron": 1.0, "triton": 900.0, "compile": 12000.0},
                     "dropped": {"liger": "raised RuntimeError: x"}}]}}
    report["triton_ops"] = {"rows": [], "failures": [{"op": "moe", "dtype": "bf16", "error": "AssertionError: boom"}]}
    md = render.markdown(report, render.derive(report))
    assert "| swiglu 4096x11264 bf16 cuda | compile | 0.300 | 1.33x | 12.00 | **picked** |" in md
    assert "| swiglu 4096x11264 bf16 cuda | triton | 0.350 | 1.14x | 0.90 |  |" in md
    assert "| swiglu 4096x11264 bf16 cuda | liger | dropped: raised RuntimeError: x |" in md
    assert "- moe bf16: failed, AssertionError: boom" in md


def test_the_report_times_the_training_runs_model():
    import parts  # the fused-op table's shapes are the training runs' model's (models.py)

    dims = parts.model_dims(smoke=False)
    assert dims == ["--hidden", "2048", "--ffn", "5632", "--heads", "16", "--groups", "4", "--seq", "4096",
                    "--micro-batch", "1"]


def test_step_spread_marks_a_ratio_that_is_not_a_measured_effect():
    report = _report()
    runs = report["training"]["runs"]
    runs["flash-attn"]["step_ms"] = [900.0, 380.0, 420.0, 400.0]
    runs["reuse-fp32-param"]["step_ms"] = [950.0, 395.0, 410.0, 404.0]  # inside the base's 380-420
    runs["swap-attention"] = dict(_run(60000, 600, 8 * 2**30), step_ms=[900.0, 590.0, 610.0, 600.0])
    report["triton_ops"] = {"error": "Traceback (most recent call last):\n  File x\nAssertionError: boom\n"}
    md = render.markdown(report, render.derive(report))
    assert "| reuse-fp32-param | 404.0 (400.0); steps 395-410 (380-420) | 1.010x (within the steps' spread) |" in md
    assert "| swap-attention | 600.0 (400.0); steps 590-610 (380-420) | 1.500x (loss) |" in md
    runs["swap-attention"]["step_ms"] = [900.0, 300.0, 310.0, 305.0]  # every step below every base step
    assert "1.500x (gain) |" in render.markdown(report, render.derive(report))
    assert "failed: AssertionError: boom (the whole output" in md and "Traceback" not in md


def _profile(step_ms=400.0):
    share = {"gemm": 0.5, "attention": 0.2, "norm": 0.05, "elementwise": 0.1, "memcpy": 0.0, "optimizer": 0.05,
             "communication": 0.0, "idle": 0.1}
    return {"mode": "device", "steps": 1, "step_ms": step_ms, "iterations": [12, 12], "share": share,
            "ms": {k: v * step_ms for k, v in share.items()},
            "top": [{"name": "nvjet_tst_192x192", "category": "gemm", "ms": 150.0, "calls": 160, "share": 0.375}]}


def test_the_why_sections_floor_profile_and_anchor():
    """The e2e table's `x floor` (median step over the compute floor), the floor's line with its
    MFU, the profiled runs' categories and top kernels, torchtitan's reason; the profiled
    iteration and its warm-up are left out of a run's step range."""
    report = _report()
    runs = report["training"]["runs"]
    runs["flash-attn"].update(profile=_profile(), profiled_iterations=[11, 12], first_iteration=1,
                              step_ms=[900.0, 380.0, 420.0, 400.0, 390.0, 395.0, 398.0, 401.0, 399.0, 402.0, 700.0,
                                       1500.0])
    report["floor"] = {"floor_ms": 250.0, "ms_by_kind": {"gemm": 200.0, "attention": 50.0}, "micro_batches": 8,
                       "micro_batch": 1, "dtype": "bfloat16", "tflops": 600.0, "mfu": 0.6067, "peak_tflops": 989.0,
                       "calls": [{"kind": "attention", "kernel": "sdpa"}]}
    report["torchtitan"] = {"ran": False, "why": "not importable here: torchtitan"}
    derived = render.derive(report)
    md = render.markdown(report, derived)
    assert "| flash-attn | 90000 | 3.00x | 300.0 | 30.0% | 9.00 | 1.60x |" in md  # 400 / 250
    assert "| all off | 30000 | 1.00x | 300.0 | 30.0% | 26.00 | 4.00x |" in md
    assert "**Compute floor**: 250.0 ms a step (GEMMs 200.0 ms, attention 50.0 ms with sdpa)" in md
    assert "600.0 TFLOP/s = 60.7% MFU of 989 TFLOP/s" in md
    assert "| flash-attn | 400.0 | 50% | 20% | 5% | 10% | 0% | 5% | 0% | 10% |" in md
    assert "| `nvjet_tst_192x192` | gemm | 150.00 | 160 | 37.5% |" in md
    assert "**torchtitan** (the single-GPU anchor): not run: not importable here: torchtitan" in md
    flash = runs["flash-attn"]
    assert render._range(flash) == [380.0, 420.0]  # 700 (warm-up) and 1500 (profiled) left out


def test_the_flag_runs_cover_every_single_rank_flag_against_flash_attention():
    import models

    assert set(models.BASE_OF) == set(models.FLAG_RUNS) and set(models.BASE_OF.values()) == {"flash-attn"}
    for flag in ("--use-fused-linear-cross-entropy", "--recompute-activation-function", "--use-fused-rmsnorm",
                 "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--recompute-norm", "--reuse-fp32-param",
                 "--gradient-accumulation-fusion", "--swap-optimizer", "--swap-attention"):
        assert [flag] in models.FLAG_RUNS.values(), flag
    argv = models.args_for(models.RUNS["flash-attn"], smoke=False)
    assert argv[-5:] == ["--profile", "--profile-step-start", "11", "--profile-step-end", "12"]
    assert "--profile" not in models.args_for(models.RUNS["fused-rope"], smoke=False)


def test_torchtitan_says_why_it_did_not_run(tmp_path):
    import parts
    import why

    got = why.torchtitan(parts.Budget(60), tmp_path, smoke=True)
    assert got["ran"] is False and "Hugging Face hub" in got["why"]
    assert ("torchtitan" in got["missing"]) == (importlib.util.find_spec("torchtitan") is None)


def _write(tmp_path: Path, report: dict) -> Path:
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.json").write_text(json.dumps(report))
    (out / "report.md").write_text(render.markdown(report, render.derive(report)))
    return out


def test_readme_section_is_generated_between_the_markers(tmp_path):
    out = _write(tmp_path, _report())
    page = tmp_path / "README.md"
    page.write_text(f"intro\n{readme.START}\nold by hand\n{readme.END}\nrest\n")
    assert readme.main([str(out), str(page)]) == 0
    text = page.read_text()
    assert "old by hand" not in text and text.startswith("intro\n") and text.endswith(f"{readme.END}\nrest\n")
    assert "on 2026-11-26: NVIDIA H100 80GB HBM3 (cuda), commit abc1234." in text
    assert "| flash-attn | 90000 |" in text
    page.write_text("no markers\n")
    with pytest.raises(SystemExit, match="markers"):
        readme.main([str(out), str(page)])


def test_a_smoke_report_is_not_the_readme_s_figures(tmp_path):
    out = _write(tmp_path, _report(smoke=True))
    page = tmp_path / "README.md"
    page.write_text(f"{readme.START}\n{readme.END}\n")
    with pytest.raises(SystemExit, match="smoke"):
        readme.main([str(out), str(page)])


def test_the_repository_accelerators_page_has_the_markers():
    """The block moved from README.md to docs/accelerators.md (issue 35: a full report would not fit the
    README's 300 lines); the default target is that page and the README points to it."""
    assert readme.PAGE == ROOT / "docs" / "accelerators.md"
    text = readme.PAGE.read_text()
    assert text.count(readme.START) == 1 and text.count(readme.END) == 1
    assert "docs/accelerators.md" in (ROOT / "README.md").read_text()


def test_without_an_accelerator_the_report_refuses_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/device_report/run.py", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no CUDA or NPU device here" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_smoke_report_why_parts_on_cpu(tmp_path):
    """--smoke with the new parts: the profiled runs' breakdowns, the floor and `x floor`, one
    flag row, torchtitan's reason (4 example runs and a floor: minutes, more on a loaded host)."""
    proc = subprocess.run([sys.executable, "benchmarks/device_report/run.py", "--smoke", "--out", str(tmp_path),
                           "--budget-s", "1800", "--parts", "floor", "training", "torchtitan", "--runs", "flash-attn",
                           "all flags", "fused-rope"], cwd=ROOT, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    runs = report["training"]["runs"]
    for name in ("flash-attn", "all flags"):
        profile = runs[name]["profile"]
        assert profile["mode"] == "host" and profile["iterations"] == [4, 4] and len(profile["top"]) == 15
        assert profile["ms"]["gemm"] > 0 and profile["ms"]["attention"] > 0, profile["ms"]
    assert runs["fused-rope"].get("profile") is None
    assert report["floor"]["floor_ms"] > 0 and report["torchtitan"]["ran"] is False
    md = (tmp_path / "report.md").read_text()
    assert "**Where a step goes**" in md and "**Compute floor**" in md and "| fused-rope |" in md
    assert "x floor |" in md and "**torchtitan**" in md


@pytest.mark.slow
def test_smoke_report_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/device_report/run.py", "--smoke", "--out", str(tmp_path),
                           "--parts", "tier", "training", "codec", "fused_ops", "--runs", "all off", "flash-attn",
                           "reuse-fp32-param"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["tier"]["counts"]["passed"] == 0 and report["tier"]["counts"]["failed"] == 0
    assert set(report["training"]["runs"]) == {"all off", "flash-attn", "reuse-fp32-param"}
    assert all("error" not in run for run in report["training"]["runs"].values()), report["training"]["runs"]
    assert report["codec"]["timings"] and report["fused_ops"]["table"]["choices"]
    assert (tmp_path / "report.md").read_text().count("| all off |") == 1


XDIST_LOG = """\
[gw0] [ 11%] PASSED tests/device/test_a.py::test_one[fp32-torch.float32]
[gw1] [ 50%] SKIPPED tests/device/test_b.py::test_sparse
[gw0] [ 75%] FAILED tests/device/test_c.py::test_weights[(4096, 8)-True]
[gw2] [100%] PASSED tests/device/test_d.py::test_peak[flash-attn reuse-fp32]
_____________________ test_weights[(4096, 8)-True] _____________________
E       AssertionError: weight bytes x0.688
FAILED tests/device/test_c.py::test_weights[(4096, 8)-True]
"""


def test_a_tier_log_gives_counts_cases_and_failure_messages():
    """A tier stopped at its cap (no junit report) or run in a call of its own still reports
    what finished: `pytest -v` lines with and without xdist, ids with spaces, the failure's
    first `E` line where the short summary has no message."""
    import parts

    got = parts.cases_from_log(XDIST_LOG)
    assert got["counts"] == {"passed": 2, "failed": 1, "skipped": 1}
    failed = [c for c in got["cases"] if c["state"] == "failed"]
    assert failed == [{"test": "tests/device/test_c.py::test_weights[(4096, 8)-True]", "state": "failed",
                       "seconds": 0.0, "message": "AssertionError: weight bytes x0.688"}]
    assert "tests/device/test_d.py::test_peak[flash-attn reuse-fp32]" in {c["test"] for c in got["cases"]}
    plain = parts.cases_from_log("tests/device/test_a.py::test_x PASSED [ 50%]\n"
                                 "tests/device/test_a.py::test_y FAILED [100%]\n"
                                 "FAILED tests/device/test_a.py::test_y - assert 1 == 2\n")
    assert plain["counts"] == {"passed": 1, "failed": 1, "skipped": 0}
    assert [c["message"] for c in plain["cases"] if c["state"] == "failed"] == ["assert 1 == 2"]


def test_a_second_call_keeps_the_first_calls_parts_of_the_same_commit(tmp_path):
    """A report longer than one lease's call is made in two (`--parts tier`, then the rest): the
    second keeps the first's sections of the same commit and device, never another commit's."""
    import run

    report = _report()
    (tmp_path / "report.json").write_text(json.dumps(report))
    kept = run.kept(tmp_path, report["meta"], ["training", "codec", "fused_ops", "triton_ops"])
    assert set(kept) == {"tier"} and kept["tier"]["counts"] == report["tier"]["counts"]
    assert kept["tier"]["measured"] == "2026-11-26"
    assert run.kept(tmp_path, {**report["meta"], "commit": "def5678"}, ["training"]) == {}
    assert run.kept(tmp_path, report["meta"], list(run.PARTS)) == {}
