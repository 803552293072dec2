"""What a user sees when the environment is wrong: one clear message, checked by substring.

Each case runs `import npuspeed.megatron_adaptor` in a fresh interpreter, as a training
script would.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from npuspeed.features.device import apex_guard
from tiers import pinned

ADAPTOR = "import npuspeed.megatron_adaptor"


def _run(code: str, env_extra: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    env = pinned(dict(os.environ))  # the CPU tier's backend
    env.pop("NPUSPEED_ARGS", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd)


def test_npu_requested_without_torch_npu():
    proc = _run(ADAPTOR, {"NPUSPEED_DEVICE": "npu"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "npuspeed: error: NPUSPEED_DEVICE=npu needs torch_npu" in proc.stderr
    assert "pip install npuspeed[npu]" in proc.stderr


def test_unknown_device():
    proc = _run(ADAPTOR, {"NPUSPEED_DEVICE": "tpu"})
    assert proc.returncode != 0
    assert "NPUSPEED_DEVICE='tpu' is not a known device" in proc.stderr
    assert "npu, cuda, cpu" in proc.stderr


def test_megatron_outside_supported_range():
    code = (
        "from packaging.version import Version\n"
        "import npuspeed.patching.versions as v\n"
        "v.megatron_version = lambda: Version('0.11.0')\n"
        + ADAPTOR
    )
    proc = _run(code)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "npuspeed: error: megatron-core 0.11.0 is not supported" in proc.stderr
    assert ">=0.12,<0.20" in proc.stderr and "0.12 through 0.19" in proc.stderr


def _fake_apex(root, nvidia: bool):
    pkg = root / "apex"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('the fake apex must never be imported')\n")
    if nvidia:
        (pkg / "multi_tensor_apply").mkdir()
        (pkg / "multi_tensor_apply" / "__init__.py").write_text("")
    return root


_APEX_PROBE = r"""
import json, sys
import torch
import npuspeed.megatron_adaptor
assert sys.modules["apex"] is None
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
spec = get_gpt_layer_local_spec()
from npuspeed.features.device.apex_guard import classify_apex
from npuspeed import cli
print("SPEC", type(spec).__name__, classify_apex())
cli.main(["report", "--json"])
"""


def test_non_nvidia_apex_is_hidden(tmp_path):
    root = _fake_apex(tmp_path / "site", nvidia=False)
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    proc = _run(_APEX_PROBE, {"PYTHONPATH": path}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not NVIDIA apex" in proc.stderr and str(root / "apex") in proc.stderr
    head, _, report = proc.stdout.partition("\n")
    assert head == "SPEC ModuleSpec blocked"
    notes = json.loads(report)["notes"]
    assert any("not NVIDIA apex" in n and "pip uninstall apex" in n for n in notes), notes


def test_classify_apex(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "apex", raising=False)
    assert apex_guard.classify_apex() == "absent"
    nvidia = _fake_apex(tmp_path / "nvidia", nvidia=True)
    monkeypatch.syspath_prepend(str(nvidia))
    assert apex_guard.classify_apex() == "nvidia"
    assert apex_guard.guard_apex() is None  # left alone
    assert "apex" not in sys.modules
    monkeypatch.setitem(sys.modules, "apex", None)
    assert apex_guard.classify_apex() == "blocked"


def test_guard_apex_blocks_other_apex(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "apex", raising=False)
    monkeypatch.syspath_prepend(str(_fake_apex(tmp_path / "other", nvidia=False)))
    assert apex_guard.classify_apex() == "other"
    try:
        message = apex_guard.guard_apex()
        assert "not NVIDIA apex" in message and "pip uninstall apex" in message
        assert sys.modules["apex"] is None
        with pytest.raises(ImportError):
            import apex  # noqa: F401
        assert apex_guard.guard_apex() is None  # once blocked, nothing more to say
    finally:
        sys.modules.pop("apex", None)
