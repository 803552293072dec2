"""The supported megatron-core range (0.12-0.19), one release at a time, opt-in.

Each entry of NPUSPEED_MEGATRON_SITES (colon-separated) is a directory holding one
megatron-core unpacked with `pip install --no-deps --target DIR megatron-core==X.Y.Z`; put
first on PYTHONPATH it shadows the installed release (run with an interpreter the wheel is
for: 0.17+ are cp312). For each: `npuspeed report --json` must apply or cleanly skip (version
range) every patch; a 4-iteration TP2+SP run of the example must train; every opt-in feature
enabled alone (tests/feature_argv.py) is applied or refused with one line naming its flag
(never an error, never silently idle); and each applied flag trains 3 iterations of a tiny
model with the losses of the same run without it (fp32: within 1e-5). With
NPUSPEED_VERSIONS_OUT=DIR the results are written there as JSON for the summary table
(tools/megatron_versions_table.py). scripts/megatron_versions.sh downloads, unpacks, runs
this per release and prints the table.

Two cheap tests always run: a megatron.core shadowing the installed one without any
package metadata (a Megatron-LM checkout on PYTHONPATH) is identified by its own
package_info, and the 0.12-only compatibility wrappers behave on stand-ins.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from feature_argv import FEATURES
from launch import ROOT, TINY, free_port, run_example

SITES = [s for s in os.environ.get("NPUSPEED_MEGATRON_SITES", "").split(":") if s]
needs_sites = pytest.mark.skipif(
    not SITES,
    reason="opt-in: set NPUSPEED_MEGATRON_SITES=DIR[:DIR...] (each from `pip install --no-deps "
           "--target DIR megatron-core==X`), or run scripts/megatron_versions.sh",
)
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--train-iters", "4"]


OUT = os.environ.get("NPUSPEED_VERSIONS_OUT")
#: ranks a parity run may use (CI may set 1: the 2-rank features then rely on their own tests)
PARITY_RANKS = int(os.environ.get("NPUSPEED_VERSIONS_PARITY_RANKS", "2"))
PARITY_ITERS = ["--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0"]
RUNNER = Path(ROOT) / "tests" / "_forked_example.py"


def _env(site: str) -> dict:
    """The release first (it shadows the installed megatron-core), then this checkout."""
    return dict(os.environ, PYTHONPATH=f"{site}:{ROOT}", PYTHONWARNINGS="ignore")


def _save(kind: str, site: str, data) -> None:
    if OUT:
        Path(OUT).mkdir(parents=True, exist_ok=True)
        (Path(OUT) / f"{kind}-{_expected_version(Path(site).resolve())}.json").write_text(json.dumps(data, indent=1))


@functools.lru_cache(maxsize=None)
def _features(site: str) -> dict:
    """tests/distributed/_release_features.py's answer for this release (once per session)."""
    proc = subprocess.run([sys.executable, str(Path(ROOT) / "tests" / "distributed" / "_release_features.py")],
                          env=_env(site), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _expected_version(site: Path) -> str:
    """From the wheel's dist-info name (independent of how npuspeed finds the version)."""
    for entry in site.iterdir():
        match = re.fullmatch(r"megatron_core-(.+)\.dist-info", entry.name)
        if match:
            return match.group(1)
    info = (site / "megatron" / "core" / "package_info.py").read_text()
    namespace: dict = {}
    exec(compile(info, "package_info.py", "exec"), namespace)
    return namespace["__version__"]


@needs_sites
@pytest.mark.parametrize("site", SITES, ids=[os.path.basename(s.rstrip("/")) for s in SITES])
def test_release(site, tmp_path):
    site_path = Path(site).resolve()
    assert (site_path / "megatron" / "core").is_dir(), f"{site} holds no megatron/core"
    expected = _expected_version(site_path)

    where = subprocess.run([sys.executable, "-c", "import megatron.core as m; print(m.__file__)"],
                           env=_env(str(site_path)), cwd=ROOT, capture_output=True, text=True)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(site_path)), (where.stdout, site_path)

    proc = subprocess.run([sys.executable, "-m", "npuspeed.cli", "report", "--json"],
                          env=_env(str(site_path)), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["megatron_core_version"] == expected
    statuses = {(p["target"], p["status"], p["reason"]) for p in report["patches"]}
    bad = [p for p in report["patches"] if p["status"] not in ("applied", "skipped")]
    assert not bad, bad
    for patch in report["patches"]:
        if patch["status"] == "skipped":  # only by version range or an upstream definition
            assert "outside" in patch["reason"] or "upstream" in patch["reason"], statuses
    assert any(p["status"] == "applied" and p["feature"] == "device" for p in report["patches"])

    run = run_example(TINY + TP2_SP, tmp_path, nproc=2, env={"PYTHONPATH": f"{site_path}:{ROOT}"})
    losses = run["losses"]
    _save("report", site, {"megatron_core_version": expected, "patches": report["patches"], "tp2_sp_losses": losses})
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses


@needs_sites
@pytest.mark.parametrize("site", SITES, ids=[os.path.basename(s.rstrip("/")) for s in SITES])
def test_release_features(site):
    """Each feature alone: applied, or refused with one line naming its flag and the release."""
    result = _features(site)
    _save("features", site, result)
    version = result["megatron_core_version"]
    assert version == _expected_version(Path(site).resolve())
    for name, outcome in result["features"].items():
        assert outcome["status"] in ("applied", "refused"), (name, outcome)
        if outcome["status"] == "applied":
            assert outcome["patches"] >= 1 or name in ("adaptive_memory", "swap_optimizer"), (name, outcome)
        else:
            line = outcome["reason"]
            assert "\n" not in line and any(f in line for f in FEATURES[name].flags), (name, line)


def _parity_rows(site: str, tmp: Path):
    """(feature, argv with, argv without) for each applied single-rank feature."""
    applied = [n for n, o in _features(site)["features"].items() if o["status"] == "applied"]
    for name in applied:
        enable = FEATURES[name]
        if enable.ranks > PARITY_RANKS:
            continue
        base = TINY + PARITY_ITERS + enable.model
        off = TINY + PARITY_ITERS + (enable.model if enable.baseline is None else enable.baseline)
        yield name, enable, base + enable.flags + ["--summary-json", str(tmp / f"{name}-on.json")], \
            off + ["--summary-json", str(tmp / f"{name}-off.json")]


def _losses(path: Path) -> list:
    return json.loads(path.read_text())["losses"] if path.exists() else []


@needs_sites
@pytest.mark.parametrize("site", SITES, ids=[os.path.basename(s.rstrip("/")) for s in SITES])
def test_release_parity(site, tmp_path):
    """Each applied flag: 3 iterations of a tiny model, losses those of the run without it."""
    rows = list(_parity_rows(site, tmp_path))
    single = [r for r in rows if r[1].ranks == 1]
    env = dict(_env(site), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for key in ("NPUSPEED_ARGS", "RANK", "WORLD_SIZE"):
        env.pop(key, None)
    payload = [{"argv": argv, "env": enable.env} for _n, enable, on, off in single for argv in (on, off)]
    proc = subprocess.run([sys.executable, str(RUNNER), "fresh"], input=json.dumps(payload), env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    outs = json.loads(proc.stdout.splitlines()[-1])
    results, failures = {}, []
    for i, (name, enable, on, off) in enumerate(single):
        for out in outs[2 * i: 2 * i + 2]:
            if out["rc"] != 0:
                failures.append(f"{name}: rc {out['rc']}: {(out['stdout'] + out['stderr'])[-1500:]}")
        results[name] = {"on": _losses(Path(on[-1])), "off": _losses(Path(off[-1]))}
    for name, enable, on, off in (r for r in rows if r[1].ranks > 1):
        try:  # a failed run is this row's failure; the other rows still run and are saved
            with_flag = run_example(on[:-2], tmp_path, nproc=enable.ranks, name=f"{name}-on", env=dict(
                enable.env, PYTHONPATH=f"{site}:{ROOT}"))
            without = run_example(off[:-2], tmp_path, nproc=enable.ranks, name=f"{name}-off",
                                  env={"PYTHONPATH": f"{site}:{ROOT}"})
        except AssertionError as exc:
            failures.append(f"{name}: {str(exc)[-1500:]}")
            results[name] = {"on": [], "off": []}
            continue
        results[name] = {"on": with_flag["losses"], "off": without["losses"]}
    for name, r in results.items():
        diff = max((abs(a - b) for a, b in zip(r["on"], r["off"])), default=math.inf)
        r["max_abs_diff"] = diff if len(r["on"]) == len(r["off"]) == 3 else math.inf
        if not r["max_abs_diff"] <= 1e-5:
            failures.append(f"{name}: losses {r['on']} vs {r['off']} without the flag")
    _save("parity", site, {n: dict(r, max_abs_diff=str(r["max_abs_diff"])) for n, r in results.items()})
    assert not failures, "\n".join(failures)


def test_shadowing_checkout_is_identified_by_package_info(tmp_path):
    """Metadata would name the pip-installed release; the patches must match the imported one."""
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("")
    (core / "package_info.py").write_text("__version__ = '0.13.0'\n")
    code = ("import sys; from npuspeed.patching.versions import megatron_version; "
            "print(megatron_version(), 'megatron.core' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(str(tmp_path)), cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # Read, not imported: megatron.core must not load before the device feature's apex guard.
    assert proc.stdout.split() == ["0.13.0", "False"]


def test_compat_fixes_for_0_12():
    """The two 0.12-only wrappers (megatron_compat.py) on stand-ins with the same signatures."""
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    from npuspeed.features.device import megatron_compat

    calls = []
    quantize = megatron_compat.quantize_param_shard_without_fp8(lambda *a, **k: calls.append(a) or "ran")
    assert quantize([], [], [], None) is None and not calls  # nothing to quantize: no TE error
    assert quantize(["p"], ["m"], [0], None) == "ran" and calls  # FP8 params: upstream decides

    def new_torch(transforms, stream, data, write_item, storage_key, serialization_format):
        return serialization_format

    def old_torch(transforms, stream, data, write_item, storage_key):
        return "old"

    write = megatron_compat.write_item_with_format(new_torch)
    assert write("t", "s", "d", "w", "k") == SerializationFormat.TORCH_SAVE  # 0.12's call
    assert write("t", "s", "d", "w", "k", "given") == "given"
    assert megatron_compat.write_item_with_format(old_torch) is old_torch
