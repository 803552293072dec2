"""The supported megatron-core range (0.12-0.16), one release at a time, opt-in.

Each entry of NPUSPEED_MEGATRON_SITES (colon-separated) is a directory holding one
megatron-core unpacked with `pip install --no-deps --target DIR megatron-core==X.Y.Z`; put
first on PYTHONPATH it shadows the installed release. For each, `npuspeed report --json`
must apply or cleanly skip (version range) every patch, and a 4-iteration TP2+SP run of
the example must train. scripts/megatron_versions.sh downloads, unpacks and runs all this.

Two cheap tests always run: a megatron.core shadowing the installed one without any
package metadata (a Megatron-LM checkout on PYTHONPATH) is identified by its own
package_info, and the 0.12-only compatibility wrappers behave on stand-ins.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch import ROOT, TINY, run_example

SITES = [s for s in os.environ.get("NPUSPEED_MEGATRON_SITES", "").split(":") if s]
needs_sites = pytest.mark.skipif(
    not SITES,
    reason="opt-in: set NPUSPEED_MEGATRON_SITES=DIR[:DIR...] (each from `pip install --no-deps "
           "--target DIR megatron-core==X`), or run scripts/megatron_versions.sh",
)
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--train-iters", "4"]


def _env(site: str) -> dict:
    return dict(os.environ, PYTHONPATH=site, PYTHONWARNINGS="ignore")


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

    run = run_example(TINY + TP2_SP, tmp_path, nproc=2, env={"PYTHONPATH": str(site_path)})
    losses = run["losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses


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
